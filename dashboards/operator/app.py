"""spectune operator dashboard (Streamlit). Start with `spectune dashboard`.

Reads everything through the REST API (SPECTUNE_API_URL) with a viewer or
operator token (SPECTUNE_TOKEN, or typed in the sidebar).
"""

from __future__ import annotations

import os

import streamlit as st

from spectune.dashboards.operator.client import Api, ApiError
from spectune.dashboards.operator.views import PAGES

RANGES = {"15 minutes": 900, "1 hour": 3600, "6 hours": 21_600, "24 hours": 86_400, "7 days": 604_800}

st.set_page_config(page_title="spectune", layout="wide")
with st.sidebar:
    st.title("spectune")
    page = st.radio("Page", list(PAGES), key="page")
    window = RANGES[st.selectbox("Time range", list(RANGES), index=1, key="range")]
    auto = st.toggle("Auto-refresh every 30 s", value=False, key="auto_refresh")
    token = st.text_input("API token", value=os.environ.get("SPECTUNE_TOKEN", ""), type="password", key="token")

api = Api(os.environ.get("SPECTUNE_API_URL", "http://127.0.0.1:8000"), token or None)
try:
    who = api.get("/api/v1/whoami")
except ApiError as exc:
    st.error(
        "Enter a valid API token in the sidebar."
        if exc.status == 401
        else f"The API refused ({exc.status}): {exc.message}"
    )
    st.stop()
st.sidebar.caption(f"Signed in as {who['name']} ({who['role']}) at {api.base_url}")


def render() -> None:
    try:
        PAGES[page](api, window, who)
    except ApiError as exc:
        st.error(f"The API answered {exc.status}: {exc.message}")
    except Exception as exc:  # an operator sees a sentence, not a stack trace
        st.error(f"Something went wrong drawing this page ({type(exc).__name__}: {exc}).")


if auto:
    st.fragment(run_every=30)(render)()
else:
    render()
