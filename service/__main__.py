"""`python -m service --model PATH_OR_ID --host H --port P` (or `llm-serve ...`): see service.launcher."""
from service.launcher import main

if __name__ == "__main__":
    main()
