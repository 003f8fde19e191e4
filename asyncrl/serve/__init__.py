"""Verifier service: the Ray Serve application (app.py), its replicas (replica.py: handle method,
idempotent retries, the OpenAI-compatible HTTP ingress) and back-ends (backends.py: rule, vLLM,
HTTP), the wire schema, deployment and live swap (deploy.py, dryrun.py), and the async client the
rollout actors use (client.py). Imports go one way: app -> backends -> replica -> schema."""
