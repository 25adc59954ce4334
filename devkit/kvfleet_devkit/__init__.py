"""Development harnesses shared by kvfleet's tests, end-to-end tests, benchmarks and ``kvfleet up
--with-operator``: a real ``redis-server`` (``redis_server``), a Kubernetes API emulator (``kube_emulator``),
a stand-in kubelet and Deployment controller (``podrunner``), the whole platform on one machine
(``local_platform``, also ``python -m kvfleet_devkit.local_platform``), and process helpers (``processes``).

Not part of the product: nothing in the engine, gateway or operator imports it. It ships in the distribution
because ``kvfleet up --with-operator`` runs it; its third-party dependencies (KMock, aiohttp, httpx) come with
the ``local`` extra (``pip install 'kvfleet[local]'``). This package re-exports nothing: import the module.
"""
