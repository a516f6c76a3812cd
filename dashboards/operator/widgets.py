"""What every page draws alike."""

from __future__ import annotations

import streamlit as st


def empty(what: str) -> None:
    """What a page shows where the API has nothing for it yet."""
    st.info(f"No {what} in this time range yet. Serve some requests (or widen the range) and it appears here.")
