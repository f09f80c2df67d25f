"""Panel 5: the tuner. Studies in an Optuna storage, the selected study's trials, its Pareto front
(two objectives) or best-so-far curve (one), and its recommendation — stored by ``tailpilot
recommend`` in the tailpilot store, else computed here. ``R`` (the app's
``action_apply_recommendation``) applies it through the same confirmation and apply path as any
other cluster change.

Every storage read and the recommendation run in worker threads: a study on PostgreSQL, or a
recommendation that replays the held-out windows, never blocks the screen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import var
from textual.widgets import DataTable, Static
from textual_plotext import PlotextPlot

from controlplane.steering import ApplyResult
from tui import render as R
from tui import tuner_data as D
from tui import tuner_render as TR
from tui.widgets import AutoSizedTable, fill_table

if TYPE_CHECKING:  # annotations only (optuna is read in tui.tuner_data, when the panel opens)
    from optuna.storages import BaseStorage

    from storage.store import Store

log = logging.getLogger(__name__)


class TunerPanel(Vertical):
    """``TunerPanel(storage, store=...)``: the Optuna storage (None: ./tailpilot-optuna.db if it
    exists) and the tailpilot store a stored recommendation is read from (None: computed here)."""

    DEFAULT_CSS = """
    TunerPanel #tuner-title { height: 1; padding: 0 1; }
    TunerPanel #tuner-message { height: auto; padding: 0 1; display: none; }
    TunerPanel #tuner-message.-shown { display: block; }
    TunerPanel #studies-table { height: 6; }
    TunerPanel #tuner-body { height: 1fr; }
    TunerPanel #trials-box { width: 1fr; }
    TunerPanel #trials-title { height: 1; padding: 0 1; }
    TunerPanel #trials-table { height: 1fr; }
    TunerPanel #tuner-right { width: 78; border-left: solid $panel; }
    TunerPanel #tuner-plot { height: 15; }
    TunerPanel #rec-box { height: 1fr; }
    TunerPanel #recommendation { height: auto; padding: 0 1; }
    TunerPanel #tuner-result { height: auto; padding: 0 1; }
    """

    last_results: var[Sequence[ApplyResult]] = var((), init=False, always_update=True)
    """What the last apply did, per replica (``ApplyResult``s), shown under the recommendation."""

    def __init__(
        self, storage: str | None = None, *, store: Store | None = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.storage_arg = storage
        self.store = store
        self.url: str | None = None
        self.storage: BaseStorage | None = None
        self.message: str | None = None
        self.studies: list[D.StudyInfo] = []
        self.study: str | None = None  # the selected study
        self.detail: D.StudyDetail | None = None
        self.detail_pending: str | None = None  # the study whose detail is being read
        self.recs: dict[str, D.RecInfo] = {}
        self._rec_pending: set[str] = set()
        self._loading = False
        self.loaded = False  # the study list has been read at least once

    def compose(self) -> ComposeResult:
        yield Static(TR.tuner_title(None, None, "loading…"), id="tuner-title")
        yield Static("", id="tuner-message")
        yield AutoSizedTable(id="studies-table", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="tuner-body"):
            with Vertical(id="trials-box"):
                yield Static(Text("trials", style="bold"), id="trials-title")
                yield AutoSizedTable(id="trials-table", cursor_type="row", zebra_stripes=True)
            with Vertical(id="tuner-right"):
                yield PlotextPlot(id="tuner-plot")
                with VerticalScroll(id="rec-box"):
                    yield Static("", id="recommendation")
                    yield Static("", id="tuner-result")

    def on_mount(self) -> None:
        t = self.query_one("#studies-table", DataTable)
        for c in TR.STUDY_COLUMNS:
            t.add_column(c, key=c)

    # --- loading ---------------------------------------------------------------------------
    async def load(self) -> None:
        """(Re)read the study list (in a thread); select the current study or the first."""
        if self._loading:
            return
        self._loading = True
        try:
            if self.storage is None:
                url, why = D.resolve_storage(self.storage_arg)
                if url is None:
                    self._show_message(why)
                    return
                self.url = url
                self.storage = await asyncio.to_thread(D.open_storage, url)
            self.studies = await asyncio.to_thread(D.list_studies, self.storage)
        except Exception as err:
            log.exception("tuner storage unreadable")
            self._show_message(f"cannot read the Optuna storage: {type(err).__name__}: {err}")
            return
        finally:
            self._loading = False
        self.loaded = True
        self._fill_studies()

    def _show_message(self, text: str | None) -> None:
        self.message = text
        msg = self.query_one("#tuner-message", Static)
        msg.update(Text(text or "", style="yellow"))
        msg.set_class(bool(text), "-shown")
        self.query_one("#tuner-title", Static).update(
            TR.tuner_title(
                self.url, None if text else len(self.studies), "no storage" if text else None
            )
        )
        if text:
            self.loaded = True

    def _fill_studies(self) -> None:
        self.query_one("#tuner-title", Static).update(TR.tuner_title(self.url, len(self.studies)))
        t = self.query_one("#studies-table", DataTable)
        fill_table(t, [TR.study_row(s) for s in self.studies], [s.name for s in self.studies])
        if not self.studies:
            self._show_message(
                "the storage holds no study yet: create one with tailpilot tune --study NAME ..."
            )
            return
        names = [s.name for s in self.studies]
        keep = self.study if self.study in names else names[0]
        t.move_cursor(row=names.index(keep))
        self.select(keep, force=True)

    @on(DataTable.RowHighlighted, "#studies-table")
    def _study_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key is not None and event.row_key.value is not None:
            self.select(str(event.row_key.value))

    def select(self, name: str, *, force: bool = False) -> None:
        # The cursor landing on the selected study (RowHighlighted, after _fill_studies) is not a
        # new selection: re-reading it would re-render the trials table under the operator's eyes.
        if (
            name == self.study
            and not force
            and (self.detail is not None or self.detail_pending == name)
        ):
            return
        self.study = name
        self.detail_pending = name
        self.run_worker(
            partial(self._load_detail, name),  # type: ignore[arg-type]  # mypy can't solve WorkType's union
            group="tuner-detail",
            exclusive=True,
            exit_on_error=False,
        )

    def _opened(self) -> BaseStorage:
        """The storage :meth:`load` opened (a study is picked only from the list it read)."""
        if self.storage is None:
            raise RuntimeError("the Optuna storage is not open")
        return self.storage

    async def _load_detail(self, name: str) -> None:
        try:
            detail = await asyncio.to_thread(D.study_detail, self._opened(), name)
        except Exception as err:
            log.exception("study unreadable")
            self._show_message(f"study {name}: {type(err).__name__}: {err}")
            return
        finally:
            if self.detail_pending == name:
                self.detail_pending = None
        if name != self.study:
            return
        self.detail = detail
        self._render_detail()
        if name in self.recs:
            self._render_rec()
        elif name not in self._rec_pending:
            self._render_rec()
            self._rec_pending.add(name)
            self.run_worker(
                partial(self._load_rec, name),  # type: ignore[arg-type]  # mypy can't solve WorkType's union
                group="tuner-rec",
                exit_on_error=False,
            )

    async def _load_rec(self, name: str) -> None:
        try:
            rec = await asyncio.to_thread(D.load_recommendation, self._opened(), name, self.store)
        except Exception as err:
            log.exception("recommendation failed")
            rec = D.RecInfo(None, "none", error=f"{type(err).__name__}: {err}")
        finally:
            self._rec_pending.discard(name)
        self.recs[name] = rec
        if name == self.study:
            self._render_rec()

    # --- rendering -------------------------------------------------------------------------
    def _render_detail(self) -> None:
        d = self.detail
        if d is None:
            return
        t = self.query_one("#trials-table", DataTable)
        t.clear(columns=True)
        for c in TR.trial_columns(d.info.objectives):
            t.add_column(c)
        fill_table(t, TR.trial_rows(d), [str(trial.number) for trial in d.trials])
        title = Text(f"trials of {d.info.name}", style="bold")
        title.append(
            f" · {len(d.trials)} · ★ = {'best' if len(d.info.objectives) == 1 else 'Pareto front'}"
            " · (prod) = trial 0, the production settings",
            style="dim",
        )
        self.query_one("#trials-title", Static).update(title)
        self._draw(TR.tuner_plot(d))

    def _draw(self, p: TR.TunerPlot) -> None:
        plot = self.query_one("#tuner-plot", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(p.title)
        if p.kind == "pareto":
            for label, (xs, ys) in p.series.items():
                front = label == "Pareto front"
                plt.scatter(
                    xs,
                    ys,
                    label=label,
                    marker="●" if front else "dot",
                    color="green" if front else "gray",
                )
                if front and len(xs) > 1:
                    plt.plot(xs, ys, color="green")
        elif p.kind == "best":
            for label, (xs, ys) in p.series.items():
                if label == "best so far":
                    plt.plot(xs, ys, label=label, color="green", marker="braille")
                else:
                    plt.scatter(xs, ys, label=label, marker="dot", color="gray")
        plt.xlabel(p.xlabel)
        plt.ylabel(p.ylabel)
        plot.refresh()

    def _render_rec(self) -> None:
        name = self.study
        rec = self.recs.get(name) if name else None
        self.query_one("#recommendation", Static).update(
            TR.recommendation_renderable(rec, loading=rec is None and name is not None)
        )

    def current_rec(self) -> D.RecInfo | None:
        return self.recs.get(self.study) if self.study else None

    def watch_last_results(self, results: Sequence[Any]) -> None:
        self.query_one("#tuner-result", Static).update(R.apply_results(results))
