"""The Tuner page: its mode, its decisions, and what each decision's setting delivered against
plain serving -- speed (``realised_*``) and latency (``realised_latency``), as the tuner measured them
(``tuner/outcomes.py``)."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from .client import Api, ApiError
from .widgets import empty


def _decisions(api: Api) -> pd.DataFrame:
    data = api.get("/api/v1/decisions", limit=1000)
    if not data:
        return pd.DataFrame()
    df = pd.DataFrame(data)
    df["reason"] = df["inputs"].map(lambda i: (i or {}).get("reason"))
    df["at"] = pd.to_datetime(df["at"])
    latency = df["realised_latency"]
    for name in ("ttft_p50", "ttft_p95", "tpot_p50"):  # the setting's latency over plain's, where both ran
        df[f"{name}_vs_plain"] = latency.map(lambda x, name=name: ((x or {}).get("vs_plain") or {}).get(name))
    df["ttft_p95_s"] = latency.map(lambda x: ((x or {}).get("setting") or {}).get("ttft_s", {}).get("p95"))
    return df.drop(columns=["inputs", "realised_latency"])


def _plain_line() -> alt.Chart:
    """A dashed rule at 1: as fast (or as slow) as plain serving."""
    return alt.Chart(pd.DataFrame({"y": [1.0]})).mark_rule(strokeDash=[4, 4]).encode(y="y:Q")


def tuner(api: Api, window_s: float, who: dict) -> None:
    st.header("Tuner")
    policy, etag = api.policy()
    mode = policy["policy"].get("global", {}).get("tuner_mode", "auto")
    st.metric("Mode (global)", mode)
    modes = ["auto", "advise", "frozen"]
    new_mode = st.selectbox("Switch mode", modes, index=modes.index(mode), key="tuner_mode")
    if st.button("Apply mode", key="apply_mode", disabled=new_mode == mode):
        try:
            api.write_policy("PATCH", {"global": {"tuner_mode": new_mode}}, etag, f"dashboard: tuner mode {new_mode}")
            st.success(f"Tuner mode is now {new_mode}.")
        except ApiError as exc:
            st.error(f"Rejected ({exc.status}): {exc.message}")
    decisions = _decisions(api)
    if decisions.empty:
        empty("tuner decisions")
        return
    st.subheader("Decisions")
    st.altair_chart(
        alt.Chart(decisions).mark_point(filled=True, size=80).encode(
            x="at:T", y=alt.Y("n_after:Q", title="N after"), color="action:N", shape="prompt_class:N",
            tooltip=["at", "prompt_class", "action", "n_before", "n_after", "predicted_speedup", "reason"],
        ),
        width="stretch",
    )  # fmt: skip
    st.dataframe(decisions, hide_index=True, key="decisions_table")
    _realised(decisions)
    _latency(decisions)


def _realised(decisions: pd.DataFrame) -> None:
    """Realised speedup against plain, as the tuner measured it (``tuner/outcomes.py``): the error
    figure counts only decisions measured in paired minutes, where the machine's drift cancels."""
    st.subheader("Realised speedup against plain")
    closed = decisions.dropna(subset=["realised_speedup"])
    if closed.empty:
        st.info("No decision has a realised speedup yet (filled in once its setting has run a while).")
        return
    closed = closed.assign(
        low=closed["realised_low"].fillna(closed["realised_speedup"]),
        high=closed["realised_high"].fillna(closed["realised_speedup"]),
    )
    over_time = alt.Chart(closed).encode(x="at:T", color="realised_estimator:N")
    interval = over_time.mark_rule().encode(y=alt.Y("low:Q", title="realised speedup (90 % interval)"), y2="high:Q")
    st.altair_chart(
        _plain_line() + interval
        + over_time.mark_point(filled=True).encode(
            y="realised_speedup:Q", shape="prompt_class:N",
            tooltip=["at", "prompt_class", "action", "n_after", "realised_speedup", "low", "high",
                     "realised_minutes", "realised_estimator"],
        ),
        width="stretch",
    )  # fmt: skip
    paired = closed[(closed["realised_estimator"] == "paired") & closed["predicted_speedup"].notna()]
    unpaired = len(closed) - len(closed[closed["realised_estimator"] == "paired"])
    st.caption(
        f"{len(closed) - unpaired} decisions measured in paired minutes (plain and N steps in the same minutes: "
        f"drift cancels), {unpaired} unpaired (plain steps from other minutes: shown, left out of the error)."
    )
    if paired.empty:
        st.warning("No decision measured in paired minutes yet: set a control_budget so some requests run plain.")
        return
    error = (paired["realised_speedup"] / paired["predicted_speedup"] - 1).abs().median()
    st.metric("Median |realised / predicted - 1|", f"{error:.1%}", help="over decisions measured in paired minutes")
    lo = float(paired[["predicted_speedup", "low"]].min().min())
    hi = float(paired[["predicted_speedup", "high"]].max().max())
    diagonal = alt.Chart(pd.DataFrame({"x": [lo, hi], "y": [lo, hi]})).mark_line(strokeDash=[4, 4]).encode(x="x", y="y")
    vs = alt.Chart(paired).encode(x=alt.X("predicted_speedup:Q", title="predicted speedup"), color="action:N")
    st.altair_chart(
        diagonal + vs.mark_rule().encode(y=alt.Y("low:Q", title="realised speedup (paired)"), y2="high:Q")
        + vs.mark_point(filled=True).encode(y="realised_speedup:Q"),
        width="stretch",
    )  # fmt: skip


def _latency(decisions: pd.DataFrame) -> None:
    """TTFT and time per token of each decision's setting against the plain requests of its class at its
    batch bucket over the same span: what speculating there cost in latency (the draft's prefill
    raises TTFT; accepted tokens lower time per token)."""
    st.subheader("Latency against plain")
    measured = decisions.dropna(subset=["ttft_p95_s"])
    if measured.empty:
        st.info("No decision has its latency measured yet (filled in when its realised speedup is).")
        return
    beside = measured.dropna(subset=["ttft_p95_vs_plain"])
    st.caption(
        f"{len(beside)} decisions with plain requests of their class beside them (control requests), "
        f"{len(measured) - len(beside)} without (no control budget, or a batch where none is drawn): "
        "their TTFT is shown, not compared."
    )
    if beside.empty:
        return
    change = beside["ttft_p95_vs_plain"].median() - 1
    st.metric("Median TTFT p95 change vs plain", f"{change:+.1%}", help="setting's p95 over plain's p95, minus 1")
    metrics = ["ttft_p95_vs_plain", "tpot_p50_vs_plain"]
    shown = beside.melt(["at", "prompt_class", "n_after"], metrics, var_name="metric", value_name="vs_plain")
    st.altair_chart(
        _plain_line() + alt.Chart(shown).mark_point(filled=True).encode(
            x="at:T", y=alt.Y("vs_plain:Q", title="setting / plain"), color="metric:N", shape="prompt_class:N",
            tooltip=["at", "prompt_class", "n_after", "metric", "vs_plain"],
        ),
        width="stretch",
    )  # fmt: skip
