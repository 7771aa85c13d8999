"""Engine layer: the step loop and its async bridge.

`tiermoe.engine.protocol` is torch-free so the server can import it; the step loop itself
(`tiermoe.engine.llm_engine`) imports torch and is loaded only by the process that runs the model.
"""
