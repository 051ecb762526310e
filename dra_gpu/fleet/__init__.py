"""`dra-gpu top`: the cluster's GPUs at a glance.

The API objects are read once at the edge into a typed `Snapshot` (snapshot.py, read.py), a pure
function turns it into the view (view.py), and renderers print it (text.py for a terminal,
as_json.py for `-o json`, with the same facts).

May import: dra_gpu.common, dra_gpu.kube, dra_gpu.model, dra_gpu.controller.
"""
