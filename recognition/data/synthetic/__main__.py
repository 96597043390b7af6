"""`python -m recognition.data.synthetic --out DIR`: generate a synthetic data set."""

from recognition.data.synthetic.cli import main

if __name__ == "__main__":
    main()
