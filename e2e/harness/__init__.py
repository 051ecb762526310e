"""The single-node e2e cluster behind `e2e/cluster`, split by job.

- config: settings from the environment, pinned versions, paths under the state dir
- processes: starting, waiting for and stopping host processes by pid; logs; small helpers
- certs: the CA, certificates and kubeconfigs (openssl)
- components: how each program is configured and started (etcd ... kubelet, the peer driver)
- cleanup: stopping everything `up` started and wiping what an old cluster left
- cli: the commands (`up`, `down`, `status`, ...) and `main`

Standard library only: it runs under whichever Python calls `e2e/cluster`.
"""
