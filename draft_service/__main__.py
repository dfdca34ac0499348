"""python -m draft_service --model PATH_OR_ID --port N"""

from draft_service.servicer import SERVICE_NAME, DraftServicer, register
from model_host.runtime import run_model_service


def main() -> None:
    run_model_service("draft_service", None, DraftServicer, register, SERVICE_NAME)


if __name__ == "__main__":
    main()
