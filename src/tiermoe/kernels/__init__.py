"""tiermoe.kernels"""
