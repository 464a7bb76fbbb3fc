"""EC2's vCPU quotas on the suite's moto server.

moto 5's Service Quotas knows only VPC's quotas (`moto/servicequotas/models.py`: any `ec2` code
is NoSuchResourceException, and GetAWSDefaultServiceQuota is not implemented). An account AWS
knows has EC2 quotas, and `up` reads them before it launches (sparknet/cluster/aws/quotas.py):
`answer_ec2_quotas` makes the server (it runs in the test process) answer GetServiceQuota for
EC2's vCPU codes from `EC2_QUOTAS`, an established account's roomy values unless a test sets its
own. The answer travels over HTTP and botocore's parser as AWS's does; a code a test removes
gets moto's own NoSuchResourceException again.
"""

from __future__ import annotations

from typing import Any

#: quota code -> vCPUs, for every EC2 vCPU quota sparknet reads
EC2_QUOTAS: dict[str, float] = dict.fromkeys(
    ("L-1216C47A", "L-DB2E81BA", "L-417A185B", "L-34B43A08", "L-3819A6DF", "L-7212CCBC"),
    100_000.0,
)


def answer_ec2_quotas() -> None:
    """Make moto's `ServiceQuotasBackend.get_service_quota` answer `EC2_QUOTAS` (once)."""
    from moto.servicequotas.models import ServiceQuotasBackend

    if getattr(ServiceQuotasBackend.get_service_quota, "ec2", False):
        return
    vpc_only = ServiceQuotasBackend.get_service_quota

    def get_service_quota(self: Any, service_code: str, quota_code: str) -> dict[str, Any]:
        if service_code == "ec2" and quota_code in EC2_QUOTAS:
            return {
                "ServiceCode": "ec2",
                "QuotaCode": quota_code,
                "Value": EC2_QUOTAS[quota_code],
                "Unit": "None",
                "Adjustable": True,
                "GlobalQuota": False,
            }
        return vpc_only(self, service_code, quota_code)

    get_service_quota.ec2 = True  # type: ignore[attr-defined]
    ServiceQuotasBackend.get_service_quota = get_service_quota  # type: ignore[method-assign]
