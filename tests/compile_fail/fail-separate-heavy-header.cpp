// expect-error: include <statedict/statedict.hpp> (declarations) and link statedict::compiled
// In separate-compilation mode a header that defines the facade's functions must not be included:
// its definitions would collide with the archive's.
#define STATEDICT_SEPARATE_COMPILATION
#include <statedict/formats/registry.hpp>

int main() { return 0; }
