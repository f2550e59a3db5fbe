# Entry points; the build itself is CMake (see README.md).
#   make bench [ARGS="--cases B1,B3 --reps 3"]   benchmark suite -> bench/results.md, bench/chart.png
#   make test                                     the whole test suite (tools/test.sh)
PYTHON ?= /usr/bin/python3
ARGS ?=

.PHONY: bench test
bench:
	$(PYTHON) bench/run.py $(ARGS)

test:
	./tools/test.sh
