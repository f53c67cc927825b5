"""The credit audit's scores (DESIGN.md section 8): each estimator against the oracle A*, as
wrong-sign rates, correlations and their bootstrap standard errors, paired differences of
correlations, the coupling's figures, and the targets the audit reports. Pure numpy: it knows no
rollout; lab/audit.py computes the estimates these functions score.
"""
import math

import numpy as np

from lab import report


def pearson(x, y) -> float:
    x, y = np.ravel(x), np.ravel(y)
    return float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else math.nan


def score(est, aux, a, thr, factual_tokens) -> dict:
    """Metrics of one estimator: est, aux (N, R) estimates and auxiliary tokens; a (N,) oracle A*.
    """
    big, R, mean = np.abs(a) > thr, est.shape[1], est.mean(1)
    rate = lambda x: float(x[big].mean()) if big.any() else math.nan  # noqa: E731
    # DEVIATION A4: 0 is no sign
    return {"wrong_sign": rate(np.sign(est) * np.sign(a)[:, None] < 0),
            "wrong_sign_mean": rate(np.sign(mean) * np.sign(a) < 0), "zero": rate(est == 0),
            "corr": pearson(est, np.repeat(a[:, None], R, 1)), "corr_mean": pearson(mean, a),
            "var": float(est.var(1, ddof=1).mean()), "aux_tokens": float(aux.mean()),
            "total_vs_grpo": float(1 + aux.sum() / R / factual_tokens), **bootstrap_se(est, a, thr)}


def bootstrap_se(est, a, thr, draws: int = 1000, seed: int = 0) -> dict:
    """Standard errors of corr and wrong_sign by the bootstrap over decisions: decisions drawn with
    replacement, each with its R repeats, so the SE counts which decisions were audited as well as
    the estimators' noise."""
    rng, (N, R) = np.random.default_rng(seed), est.shape
    corr, wrong = [], []
    for i in rng.integers(0, N, (draws, N)):
        e, x = est[i], a[i]
        corr.append(pearson(e, np.repeat(x[:, None], R, 1)))
        big = np.abs(x) > thr
        wrong.append(
            float((np.sign(e[big]) *
                   np.sign(x[big])[:, None] < 0).mean()) if big.any() else math.nan)
    sd = lambda v: float(np.std(v, ddof=1)) if np.isfinite(v).sum() > 1 else math.nan  # noqa: E731
    return {
        "corr_se": sd(np.array(corr)[np.isfinite(corr)]), "wrong_sign_se": sd(
            np.array(wrong)[np.isfinite(wrong)])
    }


PAIRS = (("TWICE", "independent"), ("TWICE", "GRPO"), ("TWICE", "VinePPO K=1"), ("TWICE", "GiGPO"),
         ("TWICE token", "TWICE"), ("TWICE token", "TWICE token (prior law)"),
         ("TWICE token budgeted", "TWICE budgeted"))


def corr_differences(ests: dict, a, draws: int = 1000, seed: int = 0) -> dict:
    """{"X - Y": (corr X - corr Y, paired bootstrap SE)} for the PAIRS present: both estimators see
    the same resampled decisions, so the SE of the difference is smaller than either corr's SE when
    their errors share decisions."""
    idx, out = np.random.default_rng(seed).integers(0, len(a), (draws, len(a))), {}
    c = lambda e, i: pearson(e[i], np.repeat(a[i][:, None], e.shape[1], 1))  # noqa: E731
    for x, y in PAIRS:
        if x in ests and y in ests:
            d = np.array([c(ests[x], i) - c(ests[y], i) for i in idx])
            d = d[np.isfinite(d)]
            out[f"{x} - {y}"] = (c(ests[x], slice(None)) - c(ests[y], slice(None)),
                                 float(d.std(ddof=1)) if len(d) > 1 else math.nan)
    return out


def coupling_stats(u, u_coupled, u_indep, coupled=None, independent=None) -> dict:
    """rho = pooled within-decision correlation of U_r and the coupled U'_r, and the variance ratio it predicts:
    Var(D_c) / Var(D_i) = 1 - 2 rho s s' / (s^2 + s'^2) (s, s' the pooled within-decision SDs of U, U'), which is
    DESIGN's 1 - rho when s = s'; against the measured ratio of the twins' D variances (shortcut
    off)."""
    cu, cc = u - u.mean(1, keepdims=True), u_coupled - u_coupled.mean(1, keepdims=True)
    su, sc = (cu * cu).sum(), (cc * cc).sum()
    rho = float((cu * cc).sum() / math.sqrt(su * sc)) if su * sc > 0 else math.nan
    vc, vi = (u - u_coupled).var(1, ddof=1).mean(), (u - u_indep).var(1, ddof=1).mean()
    return {
        "rho": rho, "predicted_ratio": 1 - rho,
        "predicted_ratio_unequal": 1 - 2 * rho * math.sqrt(su * sc) / (su + sc)
        if su + sc > 0 else math.nan, "measured_ratio": float(vc / vi) if vi > 0 else math.nan,
        "var_coupled": float(vc), "var_independent": float(vi), "sd_u": math.sqrt(
            su / u.size), "agree_coupled": float(
                (u == u_coupled).mean()), "agree_independent": float(
                    (
                        u == u_indep).mean()), "sd_u_twin": math.sqrt(
                            sc / u.size), **{
                                f"token_agreement_{k}": float(x["agree"].sum() / x["compared"].sum(
                                                              )) for k, x in (("coupled", coupled), ("independent", independent)) if x is not None and x["compared"].sum(
                                ) > 0
                            }
    }


def oracle_summary(orc, thr) -> dict:
    """Mean SE of A*; the expected share of thresholded decisions whose A* sign is itself wrong
    (normal approx.); reliability 1 - mean SE^2 / Var(A*), the factor by which oracle noise shrinks
    a squared correlation."""
    a, se, big = orc["a"], orc["se"], np.abs(orc["a"]) > thr
    flip = np.array([0.5 * math.erfc(abs(x) / max(s, 1e-12) / math.sqrt(2)) for x, s in zip(a, se)])
    return {
        "decisions": len(a), "above_threshold": int(big.sum()), "threshold": thr, "mean_se": float(
            se.mean()), "sign_noise_floor": float(flip[big].mean()) if big.any() else math.nan,
        "reliability": float(1 - np.mean(se**2) / a.var()) if a.var() > 0 else math.nan,
        "var_a": float(a.var())
    }


def targets(metrics: dict, vines: list) -> dict:
    tw = metrics["TWICE"]
    equal = min(vines, key=lambda k: abs(metrics[k]["aux_tokens"] - tw["aux_tokens"]))
    beats = lambda o: tw["wrong_sign"] <= o["wrong_sign"] and tw["corr"] > o["corr"]  # noqa: E731
    tokens, how = report.vine_tokens_at(metrics, vines, tw["corr"])
    return {"twice_wrong_sign_le_5pct": tw["wrong_sign"] <= 0.05,
            "twice_corr_ge_0.8": tw["corr"] >= 0.8,
            "better_than_independent": beats(metrics["independent"]),
            f"better_than_{equal}": beats(metrics[equal]),
            "aux_75pct_below_vineppo_at_equal_corr": 1 - tw["aux_tokens"] / tokens >= 0.75}
