"""Read ``comfy-import-guard check --json`` from stdin and fail on any finding the adapter does
not already handle.

The allow-list is ``nodes/host_surface.py``: the guard only recognises ``try/except`` guards, so
the names the adapter checks for with ``hasattr``/``getattr`` (``need`` "guarded") or uses only
on hosts without a newer name (``need`` "fallback") read as missing on hosts that lack them.
Those are reported as known; anything else fails.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import host_surface_lib  # noqa: E402

KNOWN = {u.name for u in host_surface_lib.load_surface().SURFACE if u.need in ("guarded", "fallback")}


def main() -> int:
    report = json.load(sys.stdin)
    failed = []
    for pack in report["packs"]:
        for f in pack["breaking"] + pack.get("unresolvable", []) + pack.get("signature_drift", []):
            where = f"{f.get('dotted', f)} ({f.get('file')}:{f.get('line')})"
            if f.get("dotted") in KNOWN:
                print(f"   known, guarded in the adapter: {where}")
            else:
                failed.append(where)
                print(f"!! {f.get('status', 'finding')}: {where} {f.get('detail', '')}")
        if pack.get("unparseable"):
            failed += pack["unparseable"]
            print(f"!! unparseable: {pack['unparseable']}")
    print(f"== comfy-import-guard against {report['target']} ({report['target_sha'][:9]}): "
          f"{len(failed)} unexpected finding(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
