"""kopf handlers: the thin I/O shell around the pure modules (validation, manifests, status).

Every handler is a module-level function of this package, by concern: `models` (InferenceModel
lifecycle), `model_status` (status following the Deployment and pods), `idle_sleep`, `autoscaler`, `tenants`,
`activities` (login, cleanup) and `peering` (the missing-peering-object warning). They share one
`context.OperatorContext` (configuration and clients), which reaches them through kopf's memo.

`kopf_registry(options)` registers them into a fresh `kopf.OperatorRegistry` per operator run: tests run
several operators in one process, and the timers' intervals come from each run's options.
"""

from __future__ import annotations

import kopf

from kvfleet_operator import crds, manifests
from kvfleet_operator.handlers.activities import close_clients, log_in
from kvfleet_operator.handlers.autoscaler import autoscale_model, is_autoscaled
from kvfleet_operator.handlers.context import RuntimeOptions
from kvfleet_operator.handlers.model_status import follow_deployment
from kvfleet_operator.handlers.models import delete_model, reconcile_model, resync_model
from kvfleet_operator.handlers.tenants import delete_tenant, reconcile_tenant, resync_tenant

MODEL_RESOURCE = (crds.GROUP, crds.VERSION, crds.MODEL_PLURAL)
TENANT_RESOURCE = (crds.GROUP, crds.VERSION, crds.TENANT_PLURAL)


def kopf_registry(options: RuntimeOptions) -> kopf.OperatorRegistry:
    """A new kopf registry holding every handler, with the timer intervals of ``options``.

    Deletion handlers make kopf put its finalizer on InferenceModels and Tenants."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(log_in)
    kopf.on.cleanup(registry=registry)(close_clients)

    for on_change in (kopf.on.resume, kopf.on.create, kopf.on.update):
        on_change(*MODEL_RESOURCE, registry=registry)(reconcile_model)
        on_change(*TENANT_RESOURCE, registry=registry)(reconcile_tenant)
    kopf.on.delete(*MODEL_RESOURCE, registry=registry)(delete_model)
    kopf.on.delete(*TENANT_RESOURCE, registry=registry)(delete_tenant)

    kopf.timer(
        *MODEL_RESOURCE,
        interval=options.idle_check_seconds,
        initial_delay=options.idle_check_seconds,
        registry=registry,
    )(resync_model)
    kopf.timer(
        *MODEL_RESOURCE,
        interval=options.autoscale_seconds,
        when=is_autoscaled,
        id="autoscale_model",
        registry=registry,
    )(autoscale_model)
    kopf.timer(
        *TENANT_RESOURCE,
        interval=options.resync_seconds,
        initial_delay=options.resync_seconds,
        registry=registry,
    )(resync_tenant)

    kopf.on.event(
        "apps", "v1", "deployments", labels={manifests.MODEL_LABEL: kopf.PRESENT}, registry=registry
    )(follow_deployment)
    return registry
