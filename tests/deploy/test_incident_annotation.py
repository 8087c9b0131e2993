"""The dashboard marks flight-recorder incidents on its time axis."""

from __future__ import annotations

from support.dashboard import load_dashboard


def test_incident_annotation_queries_the_incident_counter() -> None:
    (note,) = [a for a in load_dashboard()["annotations"]["list"] if a["name"] == "Incidents"]
    assert note["enable"] and note["datasource"]["uid"] == "layertap-prometheus"
    assert note["expr"].startswith("increase(layertap_incidents_total{") and 'model="$model"' in note["expr"]
    assert set(note["tagKeys"].split(",")) == {"tap", "trigger"}
