"""The fixed English prompts every evaluation (parity, paired KL) runs."""

EVAL_TEXTS = [
    "What is the capital of France? Answer in one sentence and explain how you know.",
    "Write a short story about a robot who loves the sea, the stars and the mountains.",
    "Mixture-of-Experts models route each token to a few experts out of many; explain why this saves compute.",
    "List the numbers from one to twenty, separated by commas, then say which of them are prime.",
]
