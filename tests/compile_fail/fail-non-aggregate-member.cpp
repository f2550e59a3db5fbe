// A class with a constructor and private data, neither an aggregate nor described.
// expect-error: make the class an aggregate or describe it, or specialise statedict::value_codec<T>
#include <statedict/reflect.hpp>

class Scaler {
 public:
  explicit Scaler(double s) : s_(s) {}
  [[nodiscard]] double scale() const { return s_; }

 private:
  double s_;
};

struct Config {
  Scaler scaler;
};

int main() { (void)statedict::to_value(Config{Scaler(2.0)}); }
