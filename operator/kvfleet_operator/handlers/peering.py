"""Saying, in the log, that the operator waits for its peering object.

With mandatory peering kopf waits silently until the peering object exists (the Helm chart creates it);
`watch_peering` warns every PEERING_CHECK_INTERVAL until it does, with the fix in the message.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import kopf

from kvfleet_operator.handlers.context import OperatorContext, RuntimeOptions
from kvfleet_operator.kube import KubeError, object_path

PEERING_CHECK_INTERVAL = 60.0
PEERING_LOGGER = logging.getLogger("kvfleet_operator.peering")


def peering_paths(options: RuntimeOptions) -> dict[str, str]:
    """Description -> REST path of each peering object the operator waits for (namespace globs skipped)."""
    if options.peering is None:
        return {}
    if not options.peering_namespaces:
        path = object_path("kopf.dev/v1", "ClusterKopfPeering", None, options.peering)
        return {f"ClusterKopfPeering {options.peering!r}": path}
    return {
        f"KopfPeering {options.peering!r} in namespace {ns!r}": object_path(
            "kopf.dev/v1", "KopfPeering", ns, options.peering
        )
        for ns in options.peering_namespaces
        if not any(c in ns for c in "*?![]")
    }


def peering_missing_message(options: RuntimeOptions, missing: list[str]) -> str:
    namespaced = bool(options.peering_namespaces)
    kind = "KopfPeering" if namespaced else "ClusterKopfPeering"
    example = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": options.peering}}
    return (
        f"waiting for the kopf peering object ({'; '.join(missing)}): this operator does nothing until it "
        "exists. The Helm chart creates it. Running by hand, either create it (the kopf.dev CRDs are in "
        f"crds/kopf-*.yaml): echo '{json.dumps(example)}' | kubectl apply "
        + ("-n NAMESPACE " if namespaced else "")
        + "-f -   or run a single operator with --standalone."
    )


async def watch_peering(context: OperatorContext) -> None:
    """Log a warning every PEERING_CHECK_INTERVAL while a peering object is missing; return once all exist."""
    paths = peering_paths(context.options)
    warned = False
    while paths:
        missing: list[str] = []
        for what, path in paths.items():
            try:
                if await context.kube().get(path) is None:
                    missing.append(what)
            except (KubeError, kopf.TemporaryError, aiohttp.ClientError, OSError, TimeoutError) as e:
                # e.g. a 403 or an unreachable API server: kopf reports those itself
                PEERING_LOGGER.debug("cannot check %s: %s", what, e)
        if not missing:
            if warned:
                PEERING_LOGGER.info("peering object found: %s", "; ".join(paths))
            return
        PEERING_LOGGER.warning(peering_missing_message(context.options, missing))
        warned = True
        await asyncio.sleep(PEERING_CHECK_INTERVAL)
