# Entry points; the build itself is CMake (see README.md).
#   make bench [ARGS="--cases B1,B3 --reps 3"]   benchmark suite -> bench/results.md, bench/chart.png
#                                                 (tools/bench.sh: installs what it needs first)
#   make test                                     the whole test suite (tools/test.sh)
ARGS ?=

.PHONY: bench test
bench:
	./tools/bench.sh $(ARGS)

test:
	./tools/test.sh
