"""Verifier service: Ray Serve deployments (rule, vLLM, HTTP back-ends), the OpenAI-compatible
ingress and the async client the rollout actors use."""
