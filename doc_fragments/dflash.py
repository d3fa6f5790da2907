# Copyright: dflash authors
# Apache-2.0
"""Documentation the dflash modules share (ansible.cfg: doc_fragment_plugins), named in a module's
``extends_documentation_fragment`` as ``dflash.<name in lower case>``."""


class ModuleDocFragment:
    # A module that only reads (dflash_logs, dflash_progress): the same run in check mode, nothing to diff.
    READ_ONLY = r"""
attributes:
  check_mode:
    support: full
    description: Reads the same in check mode; it never changes anything.
  diff_mode:
    support: none
    description: No diff.
"""
