"""Reward functions: math grading (math-verify), format and hallucination weighting, plug-ins
compatible with Guided-GRPO's reward files."""
