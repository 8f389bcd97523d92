"""Naive float64 reference implementations of the objective zoo, written from the spec
(/work/shared/objectives-spec.md, §1, §2, §4, §5) and the fixed public API description.

Deliberately slow and explicit: Python loops over rows and tokens, scalar torch float64 ops so that
autograd gives the reference gradient. Shares no code with ``heterorl.peer.objectives``.
Only intended for small, well-conditioned inputs (|logp - logq| well inside the log-ratio clamp).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant", "delta_l")

# objective -> (default clip, default aggregation, unit level of the reported IS weights)
DEFAULTS = {
    "grpo": (0.2, "seq_mean_token_mean", "token"),
    "dapo": ((0.2, 0.28), "token_mean", "token"),
    "dr_grpo": (0.2, "constant", "token"),
    "gspo": ((3e-4, 4e-4), "seq_mean_token_mean", "seq"),
    "gspo_token": ((3e-4, 4e-4), "seq_mean_token_mean", "seq"),
    "cispo": ((None, 0.28), "token_mean", "token"),
    "topr": (1.0, "seq_mean_token_sum", "seq"),
    "gmpo": (0.4, "seq_mean_token_mean", "seq"),
    "gepo": ((0.2, None), "seq_mean_token_mean", "seq"),  # lower side only (objectives.md)
    "gepo_plus": (0.2, "seq_mean_token_mean", "seq"),
}
TOKEN_CLIP = ("grpo", "dapo", "dr_grpo")
_UNSET = object()


def bounds(clip):
    """clip argument -> (eps_low, eps_high), None = unbounded side."""
    if clip is None:
        return None, None
    if isinstance(clip, (int, float)):
        return float(clip), float(clip)
    lo, hi = clip
    return (None if lo is None else float(lo)), (None if hi is None else float(hi))


def _f(x):
    """Detached Python float of a 0-d tensor (or a float)."""
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _valid(mask, b, t):
    return bool(float(mask[b][t]) != 0.0)


def _lengths(mask):
    B, T = len(mask), len(mask[0])
    return [sum(1 for t in range(T) if _valid(mask, b, t)) for b in range(B)]


def aggregate(name, token_loss, mask, max_len=None, alpha=1.0):
    """token_loss: [B,T] float64 tensor (may carry grad). mask: nested list / tensor of 0/1."""
    B, T = token_loss.shape
    L = _lengths(mask)
    row_sums = []
    for b in range(B):
        s = torch.zeros((), dtype=F64)
        for t in range(T):
            if _valid(mask, b, t):
                s = s + token_loss[b, t]
        row_sums.append(s)
    total = sum(row_sums, torch.zeros((), dtype=F64))
    if name == "token_mean":
        return total / max(sum(L), 1)
    if name == "seq_mean_token_mean":
        return sum((row_sums[b] / max(L[b], 1) for b in range(B)), torch.zeros((), dtype=F64)) / B
    if name == "seq_mean_token_sum":
        return total / B
    if name in ("constant", "delta_l"):
        if max_len is None:
            raise ValueError("max_len required")
        M = float(max_len)
        if name == "constant":
            return total / (B * M)
        inv = [float(L[b]) ** (-alpha) for b in range(B)]
        z = sum(inv)
        return sum((inv[b] / (M * z) * row_sums[b] for b in range(B)), torch.zeros((), dtype=F64))
    raise ValueError(name)


def ppo_obj(w, A, lo, hi, dual=None):
    """Pessimistic PPO surrogate of a 0-d weight tensor ``w`` and float advantage ``A``."""
    unclipped = w * A
    if lo is None and hi is None:
        obj = unclipped
    else:
        wc = w
        if lo is not None:
            wc = torch.clamp(wc, min=1.0 - lo)
        if hi is not None:
            wc = torch.clamp(wc, max=1.0 + hi)
        obj = torch.minimum(unclipped, wc * A)
    if dual is not None and A < 0:
        obj = torch.maximum(obj, torch.tensor(dual * A, dtype=F64))
    return obj


def _zero_grad_clip(w, A, lo, hi):
    """True when the PPO clip zeroes the gradient of this unit (spec §1.5)."""
    return bool((A > 0 and hi is not None and w > 1 + hi) or (A < 0 and lo is not None and w < 1 - lo))


def _groups(gids):
    out: dict = {}
    for b, g in enumerate(gids):
        out.setdefault(g, []).append(b)
    return out


def compute(
    name,
    logp,
    logq,
    mask,
    advantages,
    group_ids,
    clip=_UNSET,
    aggregation=None,
    max_len=None,
    delta_l_alpha=1.0,
    logratio_clamp=20.0,
    staleness=None,
    dual_clip=None,
    group_scope="prompt",
    defensive_sampling=None,
    defensive_lambda=0.5,
    defensive_schedule="staleness",
    defensive_half_staleness=8.0,
    kl_threshold=0.002,
):
    """Returns (loss 0-d tensor, info dict). ``logp`` is the leaf tensor that gets the gradient."""
    default_clip, default_agg, level = DEFAULTS[name]
    if clip is _UNSET:
        clip = default_clip
    agg = aggregation or default_agg
    lo, hi = bounds(clip)
    mask = [[float(x) for x in row] for row in torch.as_tensor(mask).double().tolist()]
    A = [float(a) for a in torch.as_tensor(advantages, dtype=F64).tolist()]
    gids = [int(g) for g in torch.as_tensor(group_ids).tolist()]
    lq = torch.as_tensor(logq).double().detach()
    B, T = len(mask), len(mask[0])
    L = _lengths(mask)
    c = float(logratio_clamp)

    def d_tok(b, t):
        return torch.clamp(logp[b, t] - lq[b, t], -c, c)

    tok = [[torch.zeros((), dtype=F64) for _ in range(T)] for _ in range(B)]
    weights = []  # detached floats over the method's units
    zeroed = []  # per unit: clip zeroes gradient / weight truncated

    if name in TOKEN_CLIP:
        for b in range(B):
            for t in range(T):
                if _valid(mask, b, t):
                    rho = torch.exp(d_tok(b, t))
                    tok[b][t] = -ppo_obj(rho, A[b], lo, hi, dual_clip)
                    weights.append(_f(rho))
                    zeroed.append(_zero_grad_clip(_f(rho), A[b], lo, hi))
    elif name in ("gspo", "gspo_token"):
        for b in range(B):
            dbar = sum(
                (logp[b, t] - lq[b, t] for t in range(T) if _valid(mask, b, t)), torch.zeros((), dtype=F64)
            ) / max(L[b], 1)
            s = torch.exp(torch.clamp(dbar, -c, c))
            weights.append(_f(s))
            zeroed.append(_zero_grad_clip(_f(s), A[b], lo, hi))
            if name == "gspo":
                lb = -ppo_obj(s, A[b], lo, hi)
                for t in range(T):
                    if _valid(mask, b, t):
                        tok[b][t] = lb
            else:
                for t in range(T):
                    if _valid(mask, b, t):
                        st = s.detach() * torch.exp(logp[b, t] - logp[b, t].detach())
                        tok[b][t] = -ppo_obj(st, A[b], lo, hi)
    elif name == "gmpo":
        for b in range(B):
            sig = (A[b] > 0) - (A[b] < 0)
            acc = torch.zeros((), dtype=F64)
            nclip = 0
            for t in range(T):
                if not _valid(mask, b, t):
                    continue
                d = d_tok(b, t)
                dc = d
                if lo is not None:
                    dc = torch.clamp(dc, min=-lo)
                if hi is not None:
                    dc = torch.clamp(dc, max=hi)
                ct = sig * torch.minimum(sig * d, sig * dc)
                nclip += int(_f(sig * dc) < _f(sig * d))
                acc = acc + ct
            R = torch.exp(acc / max(L[b], 1))
            lb = -(A[b] * R)
            weights.append(_f(R))
            zeroed.append(nclip > 0)
            for t in range(T):
                if _valid(mask, b, t):
                    tok[b][t] = lb
    elif name == "cispo":
        for b in range(B):
            for t in range(T):
                if _valid(mask, b, t):
                    rho = _f(torch.exp(d_tok(b, t)))
                    w = rho
                    if lo is not None:
                        w = max(w, 1.0 - lo)
                    if hi is not None:
                        w = min(w, 1.0 + hi)
                    tok[b][t] = -(w * A[b]) * logp[b, t]
                    weights.append(w)
                    zeroed.append(w != rho)
    elif name == "topr":
        trunc = None if clip is None else (clip if isinstance(clip, (int, float)) else clip[1])
        for b in range(B):
            S = sum(_f(logp[b, t] - lq[b, t]) for t in range(T) if _valid(mask, b, t))
            if A[b] >= 0:
                w, was = 1.0, False
            else:
                raw = math.exp(min(S, c))
                w = raw if trunc is None else min(raw, float(trunc))
                was = trunc is not None and raw > float(trunc)
            weights.append(w)
            zeroed.append(was)
            for t in range(T):
                if _valid(mask, b, t):
                    tok[b][t] = -(w * A[b]) * logp[b, t]
    elif name in ("gepo", "gepo_plus"):
        lp_bar = []
        lq_bar = []
        for b in range(B):
            n = max(L[b], 1)
            lp_bar.append(
                sum((logp[b, t] for t in range(T) if _valid(mask, b, t)), torch.zeros((), dtype=F64)) / n
            )
            lq_bar.append(sum(float(lq[b, t]) for t in range(T) if _valid(mask, b, t)) / n)
        qt = [math.exp(x) for x in lq_bar]
        scope_ids = gids if group_scope == "prompt" else [0] * B
        E = [0.0] * B
        for rows in _groups(scope_ids).values():
            e = sum(qt[i] ** 2 for i in rows) / sum(qt[i] for i in rows)
            for i in rows:
                E[i] = e
        D = list(E)
        if name == "gepo_plus":
            for b in range(B):
                kl = sum(
                    math.exp(_f(lq[b, t] - logp[b, t])) - _f(lq[b, t] - logp[b, t]) - 1.0
                    for t in range(T)
                    if _valid(mask, b, t)
                ) / max(L[b], 1)
                if kl < kl_threshold:
                    D[b] = qt[b]
        st = None if staleness is None else [float(x) for x in torch.as_tensor(staleness, dtype=F64).tolist()]
        defensive = defensive_sampling
        if defensive is None:
            defensive = st is not None and any(x > 0 for x in st)
        for b in range(B):
            pt = torch.exp(lp_bar[b])
            if defensive:
                if defensive_schedule == "fixed":
                    lam = defensive_lambda
                else:
                    delta = st[b]
                    lam = defensive_lambda * delta / (delta + defensive_half_staleness)
                w = pt / (lam * _f(pt) + (1 - lam) * D[b])
            else:
                logw = torch.clamp(lp_bar[b] - math.log(D[b]), -c, c)
                w = torch.exp(logw)
            weights.append(_f(w))
            zeroed.append(_zero_grad_clip(_f(w), A[b], lo, hi))
            lb = -ppo_obj(w, A[b], lo, hi)
            for t in range(T):
                if _valid(mask, b, t):
                    tok[b][t] = lb
    else:
        raise ValueError(name)

    tl = torch.stack([torch.stack(row) for row in tok])
    loss = aggregate(agg, tl, mask, max_len=max_len, alpha=delta_l_alpha)

    ntok = sum(L)
    ds = [_f(logp[b, t] - lq[b, t]) for b in range(B) for t in range(T) if _valid(mask, b, t)]
    info = {
        "weights": weights,
        "zeroed": zeroed,
        "kl/k1": sum(-d for d in ds) / max(ntok, 1),
        "kl/k3": sum(math.exp(d) - 1 - d for d in ds) / max(ntok, 1),
        "level": level,
    }
    return loss, info


def weight_stats(ws):
    n = len(ws)
    mean = sum(ws) / n
    var = sum((w - mean) ** 2 for w in ws) / n
    ess = sum(ws) ** 2 / (n * sum(w * w for w in ws))
    return {"is/mean": mean, "is/var": var, "is/max": max(ws), "is/ess": ess}


# ----------------------------------------------------------------------------- advantages


def advantages(name, rewards, group_ids, eps=1e-6, unbiased=True, r_min=0.0, r_max=1.0):
    R = [float(r) for r in torch.as_tensor(rewards, dtype=F64).tolist()]
    gids = [int(g) for g in torch.as_tensor(group_ids).tolist()]
    groups = _groups(gids)
    out = [0.0] * len(R)
    if name in ("grpo", "dr_grpo", "rloo"):
        for rows in groups.values():
            n = len(rows)
            if n == 1:
                continue
            mean = sum(R[i] for i in rows) / n
            if name == "dr_grpo":
                for i in rows:
                    out[i] = R[i] - mean
            elif name == "rloo":
                tot = sum(R[i] for i in rows)
                for i in rows:
                    out[i] = R[i] - (tot - R[i]) / (n - 1)
            else:
                ss = sum((R[i] - mean) ** 2 for i in rows)
                std = math.sqrt(ss / (n - 1 if unbiased else n))
                for i in rows:
                    out[i] = 0.0 if R[i] == mean else (R[i] - mean) / (std + eps)
        return out
    if name == "bnpo":
        Rt = [(r - r_min) / (r_max - r_min) for r in R]
        phat = {g: sum(Rt[i] for i in rows) / len(rows) for g, rows in groups.items()}
        ps = list(phat.values())
        P = len(ps)
        mu = sum(ps) / P
        var = sum((p - mu) ** 2 for p in ps) / (P - 1) if P > 1 else 0.0
        if var > 0:
            k = mu * (1 - mu) / var - 1
            a, bb = k * mu, k * (1 - mu)
        else:
            a = bb = 0.0
        al, be = max(1 + a / 3, 1.0), max(1 + bb / 3, 1.0)
        logbeta = math.lgamma(al) + math.lgamma(be) - math.lgamma(al + be)
        for g, rows in groups.items():
            p = phat[g]
            if not 0.0 < p < 1.0:
                continue  # every member equals the baseline: A = 0 whatever the (clamped) weight
            f = math.exp((al - 1) * math.log(p) + (be - 1) * math.log1p(-p) - logbeta)
            weight = min(1.0 / f, 1e6)
            for i in rows:
                out[i] = weight * (Rt[i] - p)
        return out
    raise ValueError(name)


# ----------------------------------------------------------------------------- canonical batch §5.1


def canonical():
    """The §5.1 batch: (logp leaf, logq, mask, A, group_ids)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    q = torch.tensor([[0.5, 0.5, 1.0], [0.8, 0.5, 0.25]], dtype=F64)
    p = torch.tensor([[0.625, 0.5, 1.0], [0.8, 0.35, 0.375]], dtype=F64)
    lq = torch.log(q).masked_fill(~mask, 0.0)
    lp = torch.log(p).masked_fill(~mask, 0.0).requires_grad_(True)
    A = torch.tensor([1.0, -0.5], dtype=F64)
    gids = torch.tensor([0, 0])
    return lp, lq, mask, A, gids


# ----------------------------------------------------------------------------- M2PO and VCPO


def m2po(logp, logq, mask, advantages, m2_threshold=0.04, weight_cap=None):
    """M2PO (AReaL's rule): mask the largest d² (row-major order among ties) while the mean of the rest is
    ≥ τ; loss = −Σ_kept r·A / (all valid tokens). Returns (loss, info with the masked (b, t) set)."""
    B, T = logp.shape
    A = [float(a) for a in advantages.tolist()]
    toks = [(b, t) for b in range(B) for t in range(T) if _valid(mask, b, t)]
    d = {bt: _f(logp[bt] - logq[bt]) for bt in toks}
    order = sorted(toks, key=lambda bt: -(d[bt] ** 2))  # Python's sort is stable: row-major among ties
    masked = set()
    for k in range(len(order) + 1):
        rest = order[k:]
        if rest and sum(d[bt] ** 2 for bt in rest) / len(rest) < m2_threshold:
            masked = set(order[:k])
            break
    else:
        masked = set(order)
    total = torch.zeros((), dtype=F64)
    capped = set()
    for b, t in toks:
        if (b, t) in masked:
            continue
        r = torch.exp(logp[b, t] - logq[b, t])
        if weight_cap is not None and _f(r) > weight_cap:
            capped.add((b, t))
            continue
        total = total - r * A[b]
    loss = total / max(len(toks), 1)
    return loss, {"masked": masked, "capped": capped, "d": d}


def vcpo(logp, logq, mask, advantages, group_ids, is_cap=8.0, baseline=True, grad_sq_norms=None):
    """VCPO's loss and ESS ratio, written out: w_b = exp(Σ_t d), W_b = w_b²·g_b, A' = A − Σ_g W A / Σ_g W,
    loss = −(1/B) Σ_b min(w_b, C)·A'_b·(1/L_b) Σ_t exp(lp − sg(lp))."""
    B, T = logp.shape
    A = [float(a) for a in advantages.tolist()]
    L = _lengths(mask)
    S = [sum(_f(logp[b, t] - logq[b, t]) for t in range(T) if _valid(mask, b, t)) for b in range(B)]
    w = [math.exp(s) for s in S]
    g = [1.0] * B if grad_sq_norms is None else [float(x) for x in grad_sq_norms.tolist()]
    Ap = list(A)
    if baseline:
        for rows in _groups([int(x) for x in group_ids.tolist()]).values():
            W = [w[i] ** 2 * g[i] for i in rows]
            base = sum(Wi * A[i] for Wi, i in zip(W, rows, strict=True)) / sum(W) if sum(W) > 0 else 0.0
            for i in rows:
                Ap[i] = A[i] - base
    loss = torch.zeros((), dtype=F64)
    for b in range(B):
        wb = w[b] if is_cap is None else min(w[b], is_cap)
        s = torch.zeros((), dtype=F64)
        for t in range(T):
            if _valid(mask, b, t):
                s = s + torch.exp(logp[b, t] - logp[b, t].detach())
        loss = loss - wb * Ap[b] * s / max(L[b], 1)
    ess = sum(w) ** 2 / (B * sum(x * x for x in w))
    return loss / B, {"ess_ratio": ess, "adv": Ap, "w": w}
