"""Streamlit dashboard: watch speculative decoding happen, token by token.

The page (``ui/app.py``) talks to the orchestrator over HTTP only; ``ui.client`` does the HTTP and
server-sent events, ``ui.render`` turns step events into token HTML, chart series and summaries.
"""
