"""Plumbing the two HTTP servers share (an engine replica, the gateway): error handling, bounded request
reads and shutdown, connection flags, edge limits, process metrics, tracing and garbage-collection tuning.

Not part of the wire contract (the rest of ``kvfleet_common``): these modules run inside servers, and most
import FastAPI or uvicorn, so nothing in the contract imports them. Import the module you need
(``from kvfleet_common.server_kit.http import ApiError``); this package re-exports nothing.
"""
