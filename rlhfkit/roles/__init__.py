"""The RL loop's roles: policy and reference (`actor.ActorRole`), critic and reward model (`critic.py`), and
how the loop reaches them wherever they run (`handles.py`: typed handles over a `RoleGroup`; `group.py`: the
group in this process; `memory.py`: per-call memory peaks and out-of-memory reports)."""
