import subprocess
import sys


def test_engine_loads_neither_ray_nor_mlflow():
    code = (
        "import sys, rayacc.engine, rayacc.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'mlflow'))\n"
        "assert 'torch' in sys.modules\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine import pulled in: {out.stdout.strip()}"


def test_config_layer_does_not_import_the_engine():
    code = (
        "import sys, rayacc.config; print('rayacc.engine' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
