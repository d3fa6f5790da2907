"""Build dflash-metrics.pyz on the controller: the metrics writer (module_utils/dflash_metrics.py) and the
module_utils it imports, as ansible/module_utils/NAME.py in one zip application the system's Python runs
(`python3 -I dflash-metrics.pyz CONFIG.json`). Deterministic (sorted, fixed times), so an unchanged writer copies
as unchanged.

Usage: python3 dflash-metrics-pyz.py OUT MODULE_UTILS_DIR NAME...
"""

import sys
import zipfile
from pathlib import Path

MAIN = """# the job role's metrics writer (module_utils/dflash_metrics.py), run by dflash-metrics-NAME.service
import sys

from ansible.module_utils.dflash_metrics import main

sys.exit(main())
"""


def add(archive, name, text):
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    archive.writestr(info, text)


def main(out, source, names):
    with zipfile.ZipFile(out, "w") as archive:
        add(archive, "__main__.py", MAIN)
        add(archive, "ansible/__init__.py", "")
        add(archive, "ansible/module_utils/__init__.py", "")
        for name in sorted(names):
            add(archive, f"ansible/module_utils/{name}.py", (Path(source) / f"{name}.py").read_text())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
