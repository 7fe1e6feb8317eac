"""The stateful tests' rule machines under every eviction policy: every invariant a machine checks must hold whatever
order the pool evicts in, so each machine runs once per policy in ``mmcache.eviction.POLICIES`` (a policy added
there is tested with no change here)."""

from mmcache.eviction import DEFAULT_POLICY, POLICIES


def per_policy(machine, namespace: dict, name: str, settings=None) -> None:
    """Put into ``namespace`` (a test module's globals) a hypothesis ``TestCase`` of ``machine`` (whose ``eviction``
    attribute names the pool's policy, None the default) for each policy: ``name`` for the default, ``name`` + the
    policy's name for the others (``TestNodePoolLru``); each with ``settings`` when given."""
    for policy in POLICIES:
        suffix = "" if policy == DEFAULT_POLICY else policy.title()
        cls = machine if not suffix else type(f"{machine.__name__}{suffix}", (machine,), {"eviction": policy})
        case = cls.TestCase
        if settings is not None:
            case.settings = settings
        namespace[name + suffix] = case
