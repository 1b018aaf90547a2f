"""What each node's probe is told of the broker its ranks will be told (health/broker.py):
the address and its CA, never the login the ranks' URL may carry (argv shows in ``ps``)."""

from __future__ import annotations

from pathlib import Path

from supervisor.gathering.launch_specs import LaunchSpecs
from supervisor.telemetry.view import TelemetryView


def args(url: str | None, ca: Path | None = None) -> tuple[str, ...]:
    return LaunchSpecs(TelemetryView(), mqtt_url=url, mqtt_ca_file=ca).broker_probe_args()


def test_the_probe_gets_the_ranks_broker_without_its_login() -> None:
    assert args("mqtt://10.0.0.5:41883") == ("--broker", "mqtt://10.0.0.5:41883")
    told = args("mqtts://rank:s3cret@broker.internal:8883", Path("/etc/ssl/ca.pem"))
    assert told == ("--broker", "mqtts://broker.internal:8883", "--broker-ca", "/etc/ssl/ca.pem")
    assert args("mqtt://[fd00::5]") == ("--broker", "mqtt://[fd00::5]:1883")
    assert args("mqtt://10.0.0.5:1883", Path("/ca.pem")) == ("--broker", "mqtt://10.0.0.5:1883"), "no TLS, no CA"
    assert args(None) == (), "no broker: nothing to prove"
