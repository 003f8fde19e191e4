"""What a verifier swap would change, before it happens: `dry_run(candidate_cfg, last=N)`.

The running replicas keep a bounded ring of the requests they answered, with their replies
(`verifier.request_ring`). The dry run deploys the candidate as a separate Serve application
(`verifier-candidate`, no HTTP route, the running `verifier` untouched), replays the newest N
stored requests through it, and compares each pair of replies the way a conversation reads them
(`parse_verifier_reply`): same STOP/guidance decision, same hallucination score, guidance length.
The candidate application is deleted afterwards, also on failure.
"""

from __future__ import annotations

import time
from typing import Any

from asyncrl.config import VerifierConfig
from asyncrl.serve.app import APP_NAME, build_app

CANDIDATE_APP = "verifier-candidate"


def _collect(handle: Any, last: int, calls: int) -> list[tuple[dict[str, Any], str]]:
    """The stored requests of every replica (several calls reach several replicas), newest last,
    one per request id."""
    seen: dict[str, tuple[dict[str, Any], str]] = {}
    for _ in range(calls):
        for request, reply in handle.recent_requests.remote(0).result():
            seen.setdefault(str(request.get("request_id") or id(request)), (request, reply))
    items = list(seen.values())
    return items[-last:] if last > 0 else items


def compare(pairs: list[tuple[dict[str, Any], str, str]], stop_token: str = "###STOP###") -> dict[str, Any]:
    """Agreement of (request, running reply, candidate reply) triples."""
    from asyncrl.verifier_protocol import parse_verifier_reply

    n = len(pairs)
    same_stop = same_score = 0
    old_len = new_len = 0
    differences = []
    for request, old, new in pairs:
        a, b = parse_verifier_reply(old, stop_token), parse_verifier_reply(new, stop_token)
        same_stop += a.kind == b.kind
        same_score += a.hallucination == b.hallucination
        old_len, new_len = old_len + len(a.guidance), new_len + len(b.guidance)
        if (a.kind, a.hallucination) != (b.kind, b.hallucination) and len(differences) < 5:
            differences.append({"request_id": request.get("request_id"), "running": old[:300], "candidate": new[:300]})
    return {"requests": n, "stop_agreement": same_stop / n if n else None,
            "score_agreement": same_score / n if n else None,
            "guidance_chars_running": old_len / n if n else None, "guidance_chars_candidate": new_len / n if n else None,
            "differences": differences}


def dry_run(candidate: VerifierConfig, last: int = 64, stop_token: str = "###STOP###",
            timeout_s: float = 300.0, rule_fn: Any = None) -> dict[str, Any]:
    """Replays the running verifier's last `last` stored requests through `candidate` (deployed
    beside it, then removed) and reports the agreement (`compare`). `rule_fn`: as in `build_app`."""
    from ray import serve

    running = serve.get_app_handle(APP_NAME)
    stored = _collect(running, last, calls=4)
    if not stored:
        return {"ok": False, "error": "the running verifier has no stored requests yet (verifier.request_ring)"}
    t0 = time.time()
    try:
        handle = serve.run(build_app(candidate, rule_fn=rule_fn), name=CANDIDATE_APP, route_prefix=None, blocking=False)
        replies = [handle.chat.remote(dict(req, request_id=f"dryrun-{i}")) for i, (req, _) in enumerate(stored)]
        bodies = [r.result(timeout_s=timeout_s) for r in replies]
    finally:
        try:
            serve.delete(CANDIDATE_APP)
        except Exception:  # noqa: BLE001 - best effort clean-up; the running app is not affected
            pass
    failed = [b for b in bodies if "error" in b]
    triples = [(req, old, b["choices"][0]["message"]["content"]) for (req, old), b in zip(stored, bodies)
               if "error" not in b]
    report = compare(triples, stop_token)
    report.update({"ok": True, "candidate_version": candidate.version, "candidate_errors": len(failed),
                   "seconds": time.time() - t0})
    return report
