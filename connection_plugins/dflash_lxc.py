# Copyright: dflash authors
# Apache-2.0
"""community.general.lxc with working pipelining.

The upstream plugin hands the attached command a non-blocking stdin and never
closes its end of that pipe, so a pipelined module (its code sent on stdin) is
read short ("Broken pipe", "No start of json char found"). This subclass feeds
stdin from a blocking pipe and closes it once written; everything else (put,
fetch, options, non-pipelined commands) is the upstream plugin's.
"""

from __future__ import annotations

DOCUMENTATION = r"""
name: dflash_lxc
short_description: Run tasks in LXC containers (community.general.lxc with working pipelining)
description:
  - The community.general.lxc connection (lxc Python bindings) with a fixed stdin for pipelined modules. Set
    C(ansible_pipelining=true) on its hosts to run each module in one attach instead of copy, run and clean up.
author: dflash authors
options:
  remote_addr:
    description: Container identifier.
    type: string
    default: inventory_hostname
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: ansible_lxc_host
  executable:
    default: /bin/sh
    description: Shell executable.
    type: string
    vars:
      - name: ansible_executable
      - name: ansible_lxc_executable
"""

import errno
import fcntl
import os
import select

from ansible import errors
from ansible.module_utils.common.text.converters import to_native
from ansible_collections.community.general.plugins.connection import lxc as upstream


class Connection(upstream.Connection):
    transport = "dflash_lxc"
    has_pipelining = True

    def exec_command(self, cmd, in_data=None, sudoable=False):
        if not in_data:
            return super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        super(upstream.Connection, self).exec_command(cmd, in_data=in_data, sudoable=sudoable)
        executable = to_native(self.get_option("executable"), errors="surrogate_or_strict")
        local_cmd = [executable, "-c", to_native(cmd, errors="surrogate_or_strict")]
        child_fds, parent_fds = [], []
        try:
            read_stdout, write_stdout = os.pipe()
            read_stderr, write_stderr = os.pipe()
            read_stdin, write_stdin = os.pipe()
            child_fds, parent_fds = [write_stdout, write_stderr, read_stdin], [read_stdout, read_stderr, write_stdin]
            self._display.vvv(f"EXEC (pipelined) {local_cmd}", host=self.container_name)
            pid = self.container.attach(upstream._lxc.attach_run_command, local_cmd, stdin=read_stdin, stdout=write_stdout,
                                        stderr=write_stderr, env_policy=upstream._lxc.LXC_ATTACH_CLEAR_ENV)  # fmt: skip
            if pid == -1:
                raise errors.AnsibleError(f"failed to attach to container {self.container_name}")
            for fd in child_fds:
                os.close(fd)
            child_fds = []
            fcntl.fcntl(write_stdin, fcntl.F_SETFL, fcntl.fcntl(write_stdin, fcntl.F_GETFL) | os.O_NONBLOCK)
            out, err = self._feed_and_read(in_data, write_stdin, read_stdout, read_stderr, parent_fds)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), out, err
        finally:
            for fd in child_fds + parent_fds:
                os.close(fd)

    @staticmethod
    def _feed_and_read(in_data, stdin, stdout, stderr, open_fds):
        """Write ``in_data`` to ``stdin`` and close it (EOF for the child) while draining stdout and stderr."""
        buf = {stdout: [], stderr: []}
        readers, writers = [stdout, stderr], [stdin]
        while readers or writers:
            try:
                ready_r, ready_w, _ = select.select(readers, writers, [])
            except InterruptedError:
                continue
            for fd in ready_w:
                try:
                    in_data = in_data[os.write(fd, in_data):]
                except OSError as exc:
                    if exc.errno == errno.EAGAIN:
                        continue
                    if exc.errno != errno.EPIPE:
                        raise
                    in_data = b""  # the command exited without reading it all: its output says why
                if not in_data:
                    writers.remove(fd)
                    open_fds.remove(fd)
                    os.close(fd)
            for fd in ready_r:
                data = os.read(fd, 65536)
                if not data:
                    readers.remove(fd)
                buf[fd].append(data)
        return b"".join(buf[stdout]), b"".join(buf[stderr])
