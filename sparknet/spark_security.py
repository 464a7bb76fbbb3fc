"""The Spark security settings every Spark sparknet starts runs with.

A cluster's daemons (`cluster.spark.spark_conf`) and every driver (`training.session`) alike.
Here, below both, since the cluster side and the training side never import each other."""

from __future__ import annotations

#: the Spark web UIs listen only here: they have no authentication, so the SSH tunnel is the only
#: way in (the daemons' RPC binds the node's private address, and the security group keeps that
#: inside the cluster)
UI_HOST = "127.0.0.1"


#: RPC encryption nobody on the path can talk down (Spark's security page recommends them): no
#: fallback to SASL (a relay that answers the first auth message with an error made both ends
#: fall back to DIGEST-MD5 without encryption), an authenticated cipher (GCM, not CTR) and the
#: auth engine that goes with it. The driver sets them too (`spark_settings.spark_settings`), and
#: passes them on to its executors (Spark hands `spark.network.*` to an executor at its start).
RPC_HARDENING = {
    "spark.network.crypto.saslFallback": "false",
    "spark.network.crypto.cipher": "AES/GCM/NoPadding",
    "spark.network.crypto.authEngineVersion": "2",
}

#: the web UIs (master, workers, the driver's) show but cannot kill stages or applications
UI_READ_ONLY = {"spark.ui.killEnabled": "false"}

#: Spark's security settings every sparknet cluster runs with (the secret comes on top)
SECURITY = {
    "spark.authenticate": "true",
    "spark.network.crypto.enabled": "true",
    **RPC_HARDENING,
    "spark.io.encryption.enabled": "true",
    # the REST submission server (port 6066) takes jobs with no authentication at all
    "spark.master.rest.enabled": "false",
    **UI_READ_ONLY,
}
