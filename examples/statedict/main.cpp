// statedict command-line tool: inspect, convert, verify (see README and docs/cli.md).
#include <statedict/statedict.hpp>

#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  if (argc >= 2 && (std::strcmp(argv[1], "--version") == 0)) {
    std::printf("statedict %s\n", statedict::version_string);
    return 0;
  }
  std::fprintf(stderr, "statedict: no command implemented in this build yet\n");
  return 2;
}
