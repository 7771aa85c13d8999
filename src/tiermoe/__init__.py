"""tiermoe: serve Mixture-of-Experts models far larger than the GPU.

Every routed expert lives in exactly one tier (GPU slots, pinned host RAM, a packed record
store on disk); the engine computes exactly what a model held wholly on one device computes.
"""

__version__ = "0.1.0"
