"""The single-node e2e cluster behind `e2e/cluster`, split by job.

- config: settings from the environment, pinned versions, paths under the state dir
- processes: starting, waiting for and stopping host processes by pid; logs; small helpers
- certs: the CA, certificates and kubeconfigs (openssl)
- components: how each program is configured and started (etcd ... kubelet, the peer driver)
- cleanup: stopping everything `up` started and wiping what an old cluster left
- cli: the commands (`up`, `down`, `status`, ...) and `main`
- skips: which skipped tests a run declares expected (the others fail the tier)
- shuffle: a test run in a shuffled order, from a seed

Standard library only: it runs under whichever Python calls `e2e/cluster`.
"""
