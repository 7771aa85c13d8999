"""Engine layer: the step loop and its async bridge.

The bridge (`tiermoe.engine.async_engine`) is torch-free so the server can import it; the step
loop itself (`tiermoe.engine.llm_engine`) imports torch and is loaded only by the process that
runs the model. The messages both sides exchange live in `tiermoe.protocol`, below them.
"""
