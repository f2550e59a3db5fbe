// expect-error: std::map keys must be std::string or an integer type
#include <statedict/reflect.hpp>

#include <map>

struct Schedule {
  std::map<double, double> lr_by_epoch;
};

int main() { (void)statedict::to_value(Schedule{}); }
