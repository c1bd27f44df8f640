"""The virtual cluster's exceptions."""


class ClusterUnavailable(RuntimeError):
    """This machine cannot host a virtual cluster (not root, no ``ip netns``, no sshd, ...)."""


class ClusterError(RuntimeError):
    """Setting up or using the virtual cluster failed."""
