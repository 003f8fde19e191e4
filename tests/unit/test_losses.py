"""Proves `asyncrl.learner.losses` against hand-derived values and gradients: the PPO surrogate
(asymmetric clip + dual clip), gspo, gspo_token, cispo (paper bounds vs the original recipe),
the three aggregation modes (Dr.GRPO's constant normaliser), every off-policy correction mode
(masked IS vs rejection only, geometric-mean vs product sequence ratios, with gradients), the KL
estimators' values and gradients in and beyond their clamps, GSPO's dual clip, the entropy bonus, the metrics' [sum, count] algebra, exact gradient accumulation (token, seq and Dr.GRPO
modes over 4 micro-batches = one batch within 1e-6), and the chunked log-prob / entropy helpers."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import LearnerConfig
from asyncrl.learner.losses import (
    METRIC_NAMES,
    entropy_from_logits,
    finalize_metrics,
    logprobs_from_logits,
    loss_normalisers,
    policy_loss,
    stack_metrics,
    sum_metrics,
    unstack_metrics,
)

torch.set_num_threads(1)
LN = math.log


def cfg(mode: str = "none", **kw) -> LearnerConfig:
    """LearnerConfig with Guided-GRPO's clip defaults (0.2 / 0.3 / dual 3) and the given mode."""
    off = kw.pop("off_policy", {})
    kl = kw.pop("kl", {})
    return LearnerConfig(off_policy={"mode": mode, **off}, kl=kl, **kw)


def run(logp_values, prox, adv, mask=None, config=None, behaviour=None, **kw):
    logp = torch.tensor(logp_values, requires_grad=True)
    prox = torch.tensor(prox) if prox is not None else None
    beh = torch.tensor(behaviour) if behaviour is not None else None
    adv = torch.tensor(adv)
    mask = torch.ones_like(adv) if mask is None else torch.tensor(mask)
    loss, metrics = policy_loss(logp, prox, beh, adv, mask, config or cfg(), **kw)
    loss.backward()
    return loss.item(), logp.grad, finalize_metrics(metrics)


# ------------------------------------------------------------------------------ loss types
def test_ppo_asymmetric_clip_and_dual_clip():
    # one token per row, anchor logp_prox = 0, so ratio = e^logp; eps_low 0.2, eps_high 0.3, c = 3
    # a: A=+1, r=e^0.5=1.6487 > 1.3 -> max(-1.6487, -1.3) = -1.3        (upper clip, grad 0)
    # b: A=+1, r=e^-0.5=0.6065       -> max(-0.6065, -0.8) = -0.6065     (lower bound inactive)
    # c: A=-1, r=0.6065 < 0.8        -> max(0.6065, 0.8) = 0.8           (lower clip, grad 0)
    # d: A=-1, r=e^1.5=4.4817        -> max(4.4817, 1.3) = 4.4817 -> dual min(4.4817, 3) = 3
    # token mean = (-1.3 - 0.606531 + 0.8 + 3) / 4 = 0.473367
    logp = [[0.5], [-0.5], [-0.5], [1.5]]
    loss, grad, m = run(logp, [[0.0]] * 4, [[1.0], [1.0], [-1.0], [-1.0]])
    assert loss == pytest.approx((-1.3 - math.exp(-0.5) + 0.8 + 3.0) / 4, abs=1e-6)
    # d/dlogp (-A r)/4 = -A r / 4 only on the unclipped row b
    torch.testing.assert_close(grad, torch.tensor([[0.0], [-math.exp(-0.5) / 4], [0.0], [0.0]]))
    assert m["train/clipfrac_high"] == 0.25 and m["train/clipfrac_low"] == 0.25
    assert m["train/clipfrac_dual"] == 0.25
    # ppo_kl = mean(prox - logp) = mean(-0.5, 0.5, 0.5, -1.5) = -0.25
    assert m["train/ppo_kl"] == pytest.approx(-0.25)
    assert m["loss/pg"] == pytest.approx(loss, abs=1e-6) and m["loss/total"] == pytest.approx(loss, abs=1e-6)


def test_gspo_sequence_ratio_and_clip():
    # one sequence, log-ratios [0.2, 0.6] -> s = 0.4, ratio e^0.4 = 1.4918 > 1.3, A = +1
    # -> each token -1.3, token mean -1.3, fully clipped: grad 0, clipfrac_high 1
    loss, grad, m = run([[0.2, 0.6]], [[0.0, 0.0]], [[1.0, 1.0]], config=cfg(loss_type="gspo"))
    assert loss == pytest.approx(-1.3)
    assert grad.abs().max() == 0 and m["train/clipfrac_high"] == 1.0


def test_gspo_vs_gspo_token_gradients():
    # log-ratios [0.1, -0.1] -> s = 0, ratio 1 (unclipped); token advantages A = [1, 3]
    # value: mean(-1 * 1, -3 * 1) = -2 for both
    # gspo: loss = mean_t(-A_t e^s), ds/dlogp_t = 1/2 -> grad_t = (-1 - 3)/2 * 1/2 = -1 for each t
    # gspo_token: l_t = sg(s) + logp_t - sg(logp_t) -> grad_t = -A_t / 2 = [-0.5, -1.5]
    loss, grad, _ = run([[0.1, -0.1]], [[0.0, 0.0]], [[1.0, 3.0]], config=cfg(loss_type="gspo"))
    assert loss == pytest.approx(-2.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0]]))
    loss, grad, _ = run([[0.1, -0.1]], [[0.0, 0.0]], [[1.0, 3.0]], config=cfg(loss_type="gspo_token"))
    assert loss == pytest.approx(-2.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, -1.5]]))


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token"])
def test_gspo_dual_clip(loss_type):
    # one sequence, log-ratios [1.5, 1.5] -> s = 1.5, ratio e^1.5 = 4.481689, A = -1 on both tokens
    # clip: max(-A r, -A clip(r, 0.8, 1.3)) = max(4.4817, 1.3) = 4.4817; dual: min(4.4817, c = 3) = 3
    # -> loss 3 per token, constant: gradient 0, every token dual-clipped
    loss, grad, m = run([[1.5, 1.5]], [[0.0, 0.0]], [[-1.0, -1.0]], config=cfg(loss_type=loss_type))
    assert loss == pytest.approx(3.0, abs=1e-6)
    assert grad.abs().max() == 0 and m["train/clipfrac_dual"] == 1.0
    # below the dual bound: log-ratios [0.3, 0.7] -> s = 0.5, r = e^0.5 = 1.648721 > 1.3 but A < 0,
    # so max(1.6487, 1.3) = 1.6487 < 3 stays; loss = -A e^s = 1.648721 on both tokens
    # gspo: dloss/dlogp_t = -A e^s ds/dlogp_t = 1.648721 / 2 for each t (s is the mean of 2)
    # gspo_token: l_t = sg(s) + logp_t - sg(logp_t): dloss/dlogp_t = -A e^s / 2 (token mean) = same
    loss, grad, m = run([[0.3, 0.7]], [[0.0, 0.0]], [[-1.0, -1.0]], config=cfg(loss_type=loss_type))
    assert loss == pytest.approx(math.exp(0.5), abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[math.exp(0.5) / 2] * 2]))
    assert m["train/clipfrac_dual"] == 0.0


def test_cispo_paper_bounds_and_original_recipe():
    # token 0: A=+1, logp=-1, ratio 0.5 (prox = -1 - ln 0.5); token 1: A=+1, logp=-2, ratio 8
    # paper (cispo_eps_low None, eps_high 4): w = [0.5, min(8, 5) = 5]
    #   L = -A sg(w) logp = [-0.5 * -1, -5 * -2] = [0.5, 10] -> mean 5.25; grad = -A w / 2
    logp = [[-1.0, -2.0]]
    prox = [[-1.0 - LN(0.5), -2.0 - LN(8.0)]]
    loss, grad, m = run(logp, prox, [[1.0, 1.0]], config=cfg(loss_type="cispo"))
    assert loss == pytest.approx(5.25, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -2.5]]))
    assert m["train/clipfrac_high"] == 0.5 and m["train/clipfrac_low"] == 0.0
    # the original's recipe (clip_ratio_low = 0): w_0 raised to 1 -> L = [1, 10] -> mean 5.5
    loss, _, m = run(logp, prox, [[1.0, 1.0]], config=cfg(loss_type="cispo", cispo_eps_low=0.0))
    assert loss == pytest.approx(5.5, abs=1e-5)
    assert m["train/clipfrac_low"] == 0.5


# ------------------------------------------------------------------------------ aggregation
AGG_MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
AGG_ADV = [[1.0, 3.0, 7.0], [-6.0, 7.0, 7.0]]  # ratio 1 -> L = -A on trained tokens: [-1, -3], [6]


@pytest.mark.parametrize(
    ("mode", "extra", "expected"),
    [
        ("token", {}, (-1 - 3 + 6) / 3),  # 2/3
        ("seq", {}, (-2 + 6) / 2),  # mean(mean(-1, -3), 6) = 2
        ("seq_sum_token_mean", {}, (-4 / 3 + 6 / 3) / 2),  # norm_length = T = 3 -> 1/3
        ("seq_sum_token_mean", {"norm_length": 4}, (-4 / 4 + 6 / 4) / 2),  # 0.25
    ],
)
def test_aggregation_modes(mode, extra, expected):
    zeros = [[0.0] * 3] * 2
    loss, _, _ = run(zeros, zeros, AGG_ADV, AGG_MASK, cfg(loss_avg_mode=mode), **extra)
    assert loss == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_constant_normaliser():
    # Dr.GRPO divides each sequence's token sum by a constant: the gradient on sequence 0's one token
    # (A = +1, ratio 1) must not change when another sequence in the batch is longer.
    # batch a: seq0 [1 token], seq1 [2 tokens]; batch b: seq0 [1 token], seq1 [4 tokens]
    # with norm_length = 8: dloss/dlogp_00 = -A / 8 / (2 sequences) = -1/16 in both batches
    # without it (T of the tensor, 2 then 4): -1/4 then -1/8 -- the weight the learner no longer uses
    def grad00(t, **kw):
        mask = [[1.0] + [0.0] * (t - 1), [1.0] * t]
        zeros = [[0.0] * t] * 2
        _, g, _ = run(zeros, zeros, [[1.0] * t] * 2, mask, cfg(loss_avg_mode="seq_sum_token_mean"), **kw)
        return float(g[0, 0])

    assert grad00(2, norm_length=8) == pytest.approx(-1 / 16) and grad00(4, norm_length=8) == pytest.approx(-1 / 16)
    assert grad00(2) == pytest.approx(-1 / 4) and grad00(4) == pytest.approx(-1 / 8)


def test_dr_grpo_norm_length_is_the_configured_response_budget():
    from asyncrl.config import Config

    # guide trains the final turn only: one turn's budget, data.max_response_length
    assert Config(data={"max_response_length": 96}).learner.norm_length == 96
    # full_turn trains every policy turn: max_turns x max_response_length (quick start: 4 x 64)
    full = Config(data={"max_response_length": 64}, rollout={"guide": {"max_turns": 4, "train_scope": "full_turn",
                                                                         "history": "full"}})
    assert full.learner.norm_length == 256
    assert Config(learner={"norm_length": 100}).learner.norm_length == 100


def test_seq_mode_gradient():
    # seq mode: grad_t = -A_t r / (tokens in its sequence) / (number of sequences)
    # seq0: -1/(2*2), -3/(2*2); seq1: 6/(1*2) = 3; masked positions 0
    zeros = [[0.0] * 3] * 2
    _, grad, _ = run(zeros, zeros, AGG_ADV, AGG_MASK, cfg(loss_avg_mode="seq"))
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.75, 0.0], [3.0, 0.0, 0.0]]))


# ------------------------------------------------------------------------------ off-policy correction
# one token per row, logp = logp_prox = 0 (ratio 1, unclipped), A = +1 -> L = -w; loss = -mean(w)
# pi_prox / mu per row = [3, 0.25, 1, 1.5]  (logp_behaviour = -ln of that)
RATIOS = [3.0, 0.25, 1.0, 1.5]
BEH = [[-LN(r)] for r in RATIOS]


@pytest.mark.parametrize(
    ("mode", "weights", "clipped"),
    [
        ("none", [1, 1, 1, 1], 0.0),
        ("tis", [2, 0.25, 1, 1.5], 0.25),  # min(r, 2)
        ("mis", [0, 0, 1, 1.5], 0.5),  # masked IS: r * 1[0.5 <= r <= 2]
        ("rs", [0, 0, 1, 1], 0.5),  # rejection only: 1[0.5 <= r <= 2]
        ("decoupled", [0, 0.25, 1, 1.5], 0.25),  # AReaL: r if r <= cap (2) else 0
    ],
)
def test_token_corrections(mode, weights, clipped):
    loss, grad, m = run([[0.0]] * 4, [[0.0]] * 4, [[1.0]] * 4, config=cfg(mode), behaviour=BEH)
    assert loss == pytest.approx(-sum(weights) / 4, abs=1e-6)
    # weights are detached: grad = -A r w / 4 = -w / 4
    torch.testing.assert_close(grad, -torch.tensor([[w / 4] for w in weights], dtype=torch.float32))
    assert m["train/is_weight_mean"] == pytest.approx(sum(weights) / 4, abs=1e-6)
    assert m["train/is_clipped_frac"] == clipped
    # mismatch_kl = mean k3(r) = mean(r - ln r - 1) = (0.901388 + 0.636294 + 0 + 0.094535) / 4
    assert m["train/mismatch_kl"] == pytest.approx(sum(r - LN(r) - 1 for r in RATIOS) / 4, abs=1e-6)


def test_masked_is_reproducer():
    # one token, logp = logp_prox = 0 (ratio e^0 = 1, unclipped), A = +1, pi_prox / mu = 1.5:
    # masked IS w = r * 1[0.5 <= r <= 2] = 1.5 -> L = -A * ratio * w = -1.5,
    # dL/dlogp = -A * w * d(e^(logp - prox))/dlogp = -1.5 (TRL token_mask, AReaL mask give the same)
    beh = [[-LN(1.5)]]
    loss, grad, m = run([[0.0]], [[0.0]], [[1.0]], config=cfg("mis"), behaviour=beh)
    assert loss == pytest.approx(-1.5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.5]]))
    assert m["train/is_clipped_frac"] == 0.0
    # rejection only keeps the token unweighted: w = 1 -> loss and grad -1
    loss, grad, _ = run([[0.0]], [[0.0]], [[1.0]], config=cfg("rs"), behaviour=beh)
    assert loss == pytest.approx(-1.0, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.0]]))


def test_masked_is_weights_an_unclipped_ratio():
    # the weight multiplies the PPO surrogate, whose gradient is -A w r where the clip is inactive:
    # logp = 0.1, prox = 0 -> r = e^0.1 = 1.105171 (inside [0.8, 1.3]); pi_prox / mu = 0.7, A = -2
    # mis: w = 0.7 -> L = max(2 * 1.105171, 2 * 1.105171) * 0.7 = 1.547240 (no dual clip: 2.21 < 6)
    #      dL/dlogp = -A w r = 2 * 0.7 * 1.105171 = 1.547240
    loss, grad, _ = run([[0.1]], [[0.0]], [[-2.0]], config=cfg("mis"), behaviour=[[-LN(0.7)]])
    assert loss == pytest.approx(2 * 0.7 * math.exp(0.1), abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[2 * 0.7 * math.exp(0.1)]]))


def test_bypass_uses_behaviour_as_anchor():
    # anchor = mu: ratio = pi/mu = [3, 0.25, 1, 1.5] (logp = 0), A = +1
    # -> max(-r, -clip(r, 0.8, 1.3)) = [max(-3, -1.3), max(-0.25, -0.8), -1, max(-1.5, -1.3)]
    #    = [-1.3, -0.25, -1, -1.3] -> mean -0.9625 (A > 0: the lower bound never binds)
    loss, _, m = run([[0.0]] * 4, None, [[1.0]] * 4, config=cfg("bypass"), behaviour=BEH)
    assert loss == pytest.approx(-0.9625, abs=1e-6)
    assert m["train/is_weight_mean"] == 1.0 and "train/mismatch_kl" not in m


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # seq0 token ratios [9, 1] -> geometric mean 3; seq1 [0.36, 1] -> 0.6
        ("seq_tis", -(2 + 2 + 0.6 + 0.6) / 4),  # w = min(gm, 2) = [2, 2, 0.6, 0.6] -> -1.3
        ("seq_mis", -(0 + 0 + 0.6 + 0.6) / 4),  # seq0 outside [0.5, 2] masked, seq1 weighted 0.6 -> -0.3
        ("seq_rs", -(0 + 0 + 1 + 1) / 4),  # rejection only: seq0 masked, seq1 weight 1 -> -0.5
    ],
)
def test_sequence_corrections(mode, expected):
    beh = [[-LN(9.0), 0.0], [-LN(0.36), 0.0]]
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    loss, _, m = run(zeros, zeros, [[1.0, 1.0], [1.0, 1.0]], config=cfg(mode), behaviour=beh)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert m["train/is_clipped_frac"] == 0.5


@pytest.mark.parametrize(
    ("mode", "grad"),
    [
        # logp = prox = 0, A = +1, token mean over 4 tokens: L_t = -w_t e^(logp_t), w detached
        # -> dloss/dlogp_t = -w_t / 4 with w from the geometric means above (3 and 0.6)
        ("seq_tis", [[-2 / 4, -2 / 4], [-0.6 / 4, -0.6 / 4]]),  # w = [2, 2, 0.6, 0.6]
        ("seq_mis", [[0.0, 0.0], [-0.6 / 4, -0.6 / 4]]),  # w = [0, 0, 0.6, 0.6]
        ("seq_rs", [[0.0, 0.0], [-1 / 4, -1 / 4]]),  # w = [0, 0, 1, 1]
    ],
)
def test_sequence_correction_gradients(mode, grad):
    beh = [[-LN(9.0), 0.0], [-LN(0.36), 0.0]]
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    _, g, _ = run(zeros, zeros, [[1.0, 1.0], [1.0, 1.0]], config=cfg(mode), behaviour=beh)
    torch.testing.assert_close(g, torch.tensor(grad))


def test_sequence_ratio_product_vs_geometric_mean():
    # seq0: token ratios [0.6, 0.6, 0.6] -> geometric mean 0.6, product 0.216
    # seq1: [0.8, 0.9, pad]            -> geometric mean sqrt(0.72) = 0.848528, product 0.72
    # logp = prox = 0, A = +1, token mean over 5 trained tokens; loss = -sum_t w_t / 5
    beh = [[-LN(0.6)] * 3, [-LN(0.8), -LN(0.9), 0.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    zeros = [[0.0] * 3] * 2
    ones = [[1.0] * 3] * 2
    gm, prod = math.sqrt(0.72), 0.72

    def loss_of(mode, seq_ratio):
        c = cfg(mode, off_policy={"seq_ratio": seq_ratio})
        return run(zeros, zeros, ones, mask, c, behaviour=beh)

    # seq_mis, geometric mean: both in [0.5, 2] -> w = [0.6 x3, gm x2]
    loss, grad, _ = loss_of("seq_mis", "geometric_mean")
    assert loss == pytest.approx(-(3 * 0.6 + 2 * gm) / 5, abs=1e-6)
    torch.testing.assert_close(grad, -torch.tensor([[0.6 / 5] * 3, [gm / 5, gm / 5, 0.0]]))
    # seq_mis, product: seq0's 0.216 < 0.5 is masked, seq1 weighted 0.72 -> -(2 * 0.72) / 5
    loss, grad, m = loss_of("seq_mis", "product")
    assert loss == pytest.approx(-2 * prod / 5, abs=1e-6)
    torch.testing.assert_close(grad, -torch.tensor([[0.0] * 3, [prod / 5, prod / 5, 0.0]]))
    assert m["train/is_clipped_frac"] == pytest.approx(3 / 5)
    # seq_tis, product: w = min(prod, 2) = [0.216 x3, 0.72 x2] -> -(0.648 + 1.44) / 5 = -0.4176
    loss, _, _ = loss_of("seq_tis", "product")
    assert loss == pytest.approx(-(3 * 0.216 + 2 * prod) / 5, abs=1e-6)


def test_missing_logprobs_raise():
    with pytest.raises(ValueError, match="logp_proximal"):
        run([[0.0]], None, [[1.0]], config=cfg("none"))
    with pytest.raises(ValueError, match="logp_behaviour"):
        run([[0.0]], [[0.0]], [[1.0]], config=cfg("tis"))


# ------------------------------------------------------------------------------ KL and entropy
def test_kl_as_loss_term():
    # A = 0 -> pg 0; logp - ref = [0.2, 0.4]; k1 token mean = 0.3
    # beta 0.1 -> loss 0.03; kl_coef override 0.5 -> 0.15, grad = 0.5 * 1/2 = 0.25 per token
    kl = {"enable": True, "estimator": "k1", "coef": 0.1}
    ref = torch.tensor([[-1.2, -1.4]])
    loss, _, m = run([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], config=cfg(kl=kl), logp_ref=ref)
    assert loss == pytest.approx(0.03, abs=1e-6) and m["loss/kl"] == pytest.approx(0.3, abs=1e-6)
    loss, grad, _ = run(
        [[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], config=cfg(kl=kl), logp_ref=ref, kl_coef=0.5
    )
    assert loss == pytest.approx(0.15, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.25, 0.25]]))
    # k3: x = ref - logp = [-0.2, -0.4] -> e^x - x - 1 = [0.018731, 0.070320]; mean 0.044526; * 0.1
    kl3 = {**kl, "estimator": "k3"}
    loss, _, _ = run([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], config=cfg(kl=kl3), logp_ref=ref)
    assert loss == pytest.approx(0.1 * (math.exp(-0.2) - 0.8 + math.exp(-0.4) - 0.6) / 2, abs=1e-7)
    # reward mode: the loss has no KL term, the metric is still logged
    klr = {**kl, "mode": "reward"}
    loss, _, m = run([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], config=cfg(kl=klr), logp_ref=ref)
    assert loss == 0.0 and m["loss/kl"] == pytest.approx(0.3, abs=1e-6)
    with pytest.raises(ValueError, match="logp_ref"):
        run([[-1.0]], [[-1.0]], [[0.0]], config=cfg(kl=kl))


@pytest.mark.parametrize(
    ("estimator", "logp", "ref", "value", "grad"),
    [
        # d = logp - ref; k1 = d -> d/dlogp 1; abs = |d| -> sign(d); k2 = d^2 / 2 -> d
        ("k1", 0.0, 0.5, -0.5, 1.0),
        ("abs", 0.0, 0.5, 0.5, -1.0),
        ("k2", 0.0, 0.5, 0.125, -0.5),
        # k3 = e^x - x - 1, x = ref - logp; unclamped: d/dlogp = -(e^x - 1) = 1 - e^x
        ("k3", 0.0, -1.0, math.exp(-1) + 1 - 1, 1 - math.exp(-1)),  # x = -1: 0.367879, grad 0.632121
        ("k3", 0.0, 2.0, math.exp(2) - 3, 1 - math.exp(2)),  # x = 2: 4.389056, grad -6.389056
        ("k3", 0.0, -10.5, math.exp(-10.5) + 9.5, 1 - math.exp(-10.5)),  # 9.500028 < 10: not clamped yet
        # output clamp [-10, 10]: x = -12 -> e^-12 + 11 > 10 -> 10, gradient 0
        ("k3", 0.0, -12.0, 10.0, 0.0),
        # x = 3 -> e^3 - 4 = 16.09 > 10 -> 10, gradient 0
        ("k3", 0.0, 3.0, 10.0, 0.0),
        # input clamp: x = -30 -> -20 (gradient 0 through the clamp), value 19 -> clamped to 10
        ("k3", 0.0, -30.0, 10.0, 0.0),
    ],
)
def test_kl_estimator_values_and_gradients(estimator, logp, ref, value, grad):
    # KL as a loss term with A = 0 and one token: loss = beta * kl, dloss/dlogp = beta * dkl/dlogp
    kl = {"enable": True, "estimator": estimator, "coef": 0.5}
    loss, g, m = run([[logp]], [[logp]], [[0.0]], config=cfg(kl=kl), logp_ref=torch.tensor([[ref]]))
    assert m["loss/kl"] == pytest.approx(value, abs=1e-5)
    assert loss == pytest.approx(0.5 * value, abs=1e-5)
    torch.testing.assert_close(g, torch.tensor([[0.5 * grad]]), atol=1e-5, rtol=1e-5)


def test_entropy_bonus_and_metric():
    # A = 0; entropy [1, 2] -> token mean 1.5; coef 0.01 -> loss = -0.015
    ent = torch.tensor([[1.0, 2.0]])
    loss, _, m = run([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], config=cfg(entropy_coef=0.01), entropy=ent)
    assert loss == pytest.approx(-0.015) and m["train/entropy"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="entropy"):
        run([[0.0]], [[0.0]], [[0.0]], config=cfg(entropy_coef=0.01))


# ------------------------------------------------------------------------------ accumulation
def _random_batch(seed: int, n: int = 8, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    mask[0, 0] = 0.0  # a hole, as in multi-turn samples
    base = -torch.rand(n, t, generator=g) * 2
    params = base + torch.randn(n, t, generator=g) * 0.3
    prox = base + torch.randn(n, t, generator=g) * 0.05
    beh = prox + torch.randn(n, t, generator=g) * 0.3
    ref = base + torch.randn(n, t, generator=g) * 0.1
    adv = torch.randn(n, 1, generator=g).expand(n, t) * mask
    return params, prox, beh, ref, adv, mask


@pytest.mark.parametrize(
    ("avg", "loss_type", "mode"),
    [
        ("token", "ppo", "tis"),
        ("token", "gspo_token", "decoupled"),
        ("seq", "ppo", "mis"),
        ("seq", "gspo", "seq_tis"),
        ("seq_sum_token_mean", "cispo", "none"),
    ],
)
def test_gradient_accumulation_is_exact(avg, loss_type, mode):
    params, prox, beh, ref, adv, mask = _random_batch(0)
    config = cfg(mode, loss_type=loss_type, loss_avg_mode=avg, kl={"enable": True, "coef": 0.05})

    def loss_of(p, rows, **kw):
        return policy_loss(
            p[rows], prox[rows], beh[rows], adv[rows], mask[rows], config, logp_ref=ref[rows], **kw
        )

    full = params.clone().requires_grad_()
    full_loss, full_metrics = loss_of(full, slice(None))
    full_loss.backward()

    # 4 micro-batches of 2 sequences; normalisers summed over the whole batch first
    chunks = [slice(i, i + 2) for i in range(0, 8, 2)]
    counts = [loss_normalisers(mask[c]) for c in chunks]
    num_tokens, num_seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    assert (num_tokens, num_seqs) == loss_normalisers(mask)
    acc = params.clone().requires_grad_()
    parts, total = [], 0.0
    for c in chunks:
        loss, metrics = loss_of(acc, c, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
        loss.backward()
        total += loss.item()
        parts.append(metrics)
    assert total == pytest.approx(full_loss.item(), abs=1e-6)
    assert (acc.grad - full.grad).abs().max().item() < 1e-6
    merged = finalize_metrics(sum_metrics(parts))
    for name, value in finalize_metrics(full_metrics).items():
        assert merged[name] == pytest.approx(value, abs=1e-6), name


def test_locally_normalised_micro_batches_are_not_exact():
    # the test above has teeth: micro-batch-local token means, averaged (no global normaliser), differ
    params, prox, beh, ref, adv, mask = _random_batch(1)
    config = cfg("none", loss_avg_mode="token")
    full = policy_loss(params, prox, beh, adv, mask, config)[0].item()
    local = (
        sum(
            policy_loss(params[c], prox[c], beh[c], adv[c], mask[c], config)[0].item()
            for c in (slice(0, 1), slice(1, 8))
        )
        / 2
    )
    assert abs(local - full) > 1e-4


# ------------------------------------------------------------------------------ metric helpers
def test_metrics_sum_count_algebra():
    # two micro-batches: [sum 1, count 2] + [sum 2, count 2] -> 3 / 4; count-0 metrics dropped
    a = {name: torch.tensor([0.0, 0.0], dtype=torch.float64) for name in METRIC_NAMES}
    b = dict(a)
    a["train/ppo_kl"] = torch.tensor([1.0, 2.0], dtype=torch.float64)
    b["train/ppo_kl"] = torch.tensor([2.0, 2.0], dtype=torch.float64)
    merged = sum_metrics([a, b])
    stacked = stack_metrics(merged)
    assert stacked.shape == (len(METRIC_NAMES), 2)
    assert finalize_metrics(unstack_metrics(stacked)) == {"train/ppo_kl": 0.75}


# ------------------------------------------------------------------------------ log-probs / entropy
def test_logprobs_and_entropy_hand_values():
    # logits [0, ln 3]: p = [1/4, 3/4]; logp(label 1) = ln 0.75 = -0.287682
    # T = 2: logits/2 = [0, ln3/2] -> p1 = sqrt3 / (1 + sqrt3) = 0.633975 -> ln = -0.455706
    # entropy (T=1) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = torch.tensor([[[0.0, LN(3.0)]]])
    labels = torch.tensor([[1]])
    assert logprobs_from_logits(logits, labels).item() == pytest.approx(LN(0.75), abs=1e-6)
    assert logprobs_from_logits(logits, labels, 2.0).item() == pytest.approx(
        LN(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6
    )
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.25 * LN(0.25) + 0.75 * LN(0.75)), abs=1e-6)
    # uniform over 5 tokens: entropy ln 5
    assert entropy_from_logits(torch.zeros(1, 5)).item() == pytest.approx(LN(5.0), abs=1e-6)


def test_chunked_helpers_match_unchunked_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    lp = logprobs_from_logits(logits, labels, 0.7, chunk_rows=4)  # 15 rows -> 4 chunks
    ent = entropy_from_logits(logits, 0.7, chunk_rows=4)
    w1, w2 = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)  # non-uniform upstream grads
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    logq = torch.log_softmax(logits / 0.7, dim=-1)
    ref_lp = logq.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(logq.exp() * logq).sum(-1)
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(chunked_grad, logits.grad)
    # bf16 logits: fp32 outputs, a bf16 gradient close to the fp32 one
    half = logits.detach().bfloat16().requires_grad_()
    out = logprobs_from_logits(half, labels, 0.7, chunk_rows=4)
    assert out.dtype == torch.float32
    (out * w1).sum().backward()
    logits.grad = None
    logq = torch.log_softmax(logits / 0.7, dim=-1)
    (logq.gather(-1, labels[..., None]).squeeze(-1) * w1).sum().backward()
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(half.grad.float(), logits.grad, atol=3e-2, rtol=3e-2)
