"""``python -m shoal.env``: print the environment report (the same as ``shoalrun --check-build`` without hosts)."""

from shoal.runner.env_report import report

if __name__ == "__main__":
    print(report())
