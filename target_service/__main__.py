"""python -m target_service --model PATH_OR_ID --port N"""

from model_host.runtime import run_model_service
from target_service.servicer import SERVICE_NAME, TargetServicer, register


def main() -> None:
    run_model_service("target_service", None, TargetServicer, register, SERVICE_NAME)


if __name__ == "__main__":
    main()
