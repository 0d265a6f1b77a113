"""The grouped bar chart that several benchmarks save next to their JSON."""


def grouped_bars(path, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str,
                 log: bool = False, figsize=(12, 5)):
    """One group of bars per label, one bar per series (missing values as 0), saved as a PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=figsize)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
