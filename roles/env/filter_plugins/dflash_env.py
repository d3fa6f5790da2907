"""Filters of the env role: one KEY="VALUE" line of a systemd EnvironmentFile, escaped."""

from __future__ import annotations

import re

from ansible.errors import AnsibleFilterError

KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_line(key, value) -> str:
    """``KEY="VALUE"`` that systemd's EnvironmentFile= reads back as VALUE: inside double quotes systemd
    unescapes backslash, double quote, '$' and backquote; a newline would start a new variable, so it is
    refused (with the key named, never the value: it may be a secret)."""
    key = str(key)
    if not KEY_PATTERN.match(key):
        raise AnsibleFilterError(f"environment variable name {key!r} is not valid: use letters, digits and '_', "
                                 "not starting with a digit")
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise AnsibleFilterError(f"environment variable {key}: the value holds a newline or NUL, which an environment "
                                 "file cannot carry; give it on one line")
    return key + '="' + re.sub(r'([\\"$`])', r"\\\1", text) + '"'


class FilterModule:
    def filters(self):
        return {"dflash_env_line": env_line}
