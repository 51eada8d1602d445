"""fedpart: multi-process federated learning over gRPC for partial-parameter (body/head) algorithms.

The package's parts live in folders of the repository mapped into this namespace
(pyproject.toml): ``fedpart.proto`` (the wire protocol), ``fedpart.common`` (what server and
client share), ``fedpart.server``, ``fedpart.client``, ``fedpart.api`` (the public plugin surface
and the loader of exported models), ``fedpart.deploy`` (the local launcher and the run credentials,
beside the images, compose files and manifests), ``fedpart.report`` (reports
over run directories) and ``fedpart.cli`` (the ``fedpart`` command).
``python -m fedpart`` is the ``fedpart`` command. The instruments of the tests and measurements
(the fault relay, the load generator) live in the repository's ``lab/``, outside this package."""
