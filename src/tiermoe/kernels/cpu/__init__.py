"""The CPU lane's compiled kernel: lane_kernel.cpp (+ lane_dot.h), built and loaded by native.py."""
