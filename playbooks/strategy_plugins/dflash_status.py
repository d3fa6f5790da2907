# Copyright: dflash authors
# Apache-2.0
"""dflash_status: Ansible's linear strategy, with the exit status of a status report.

status.yml fails a host whose job is unhealthy (hung, crashed, failed to start, lost, driver mismatch) after
reporting every job. ansible-playbook exits 2 for any failed host, which the project's exit codes give to bad input
(docs/operations.md, Job states); `make status` and `dflash ops status` exit 1 for an unhealthy job. When every
failed host of the play failed only for that reason (the play set ``_dflash_status_unhealthy`` on it just before),
this strategy ends the play with 1, ansible-playbook's exit status then; any other failure (an unknown variable,
an unreachable container) keeps Ansible's own (2, 4).

Found beside the playbooks (``strategy_plugins/``); status.yml names it with ``strategy: dflash_status``.
ansible-core 2.19 warns that strategy plugins outside ansible.builtin are deprecated (one DEPRECATION WARNING line per
run): no other part of a playbook sets ansible-playbook's exit status (a failed task is 2, an error in a play keyword
4). Should a later ansible-core drop them, status.yml exits 2 again for an unhealthy job, tests/ansible/
test_ansible_status_exit.py says so, and `make status` / `dflash ops status` keep their 1.
"""

from __future__ import annotations

from ansible.plugins.strategy.linear import StrategyModule as LinearStrategy

UNHEALTHY_FACT = "_dflash_status_unhealthy"


class StrategyModule(LinearStrategy):
    def run(self, iterator, play_context):
        result = super().run(iterator, play_context)
        failed = list(self._tqm._failed_hosts)
        if result != self._tqm.RUN_FAILED_HOSTS or not failed or self._tqm._unreachable_hosts:
            return result
        facts = self._variable_manager._nonpersistent_fact_cache
        if all(bool(facts.get(host, {}).get(UNHEALTHY_FACT)) for host in failed):
            return self._tqm.RUN_ERROR  # 1: a job is unhealthy (reported above)
        return result
