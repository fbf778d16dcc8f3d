"""`python -m lorafleet_services.gateway`: run the gateway until SIGTERM."""

from lorafleet_services.gateway.service import main

if __name__ == "__main__":
    main()
