"""A user script without an `if __name__ == "__main__":` guard must work: the spawned engine
core must not re-run the script's top level (which would start a second engine)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import asyncio
    from v1_engine import AsyncEngine, SamplingParams

    print("TOP-LEVEL RAN", flush=True)

    async def main():
        async with AsyncEngine(max_model_len=256, num_kv_blocks=64) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=4)
            async for out in engine.generate("The capital of France is", params, "r1"):
                if out.finished:
                    print("TOKENS", len(out.outputs[0].token_ids) > 0, flush=True)

    asyncio.run(main())
    """
)


def test_script_without_main_guard(tmp_path: Path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("TOP-LEVEL RAN") == 1
    assert "TOKENS True" in result.stdout
