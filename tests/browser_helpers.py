"""A real JupyterLab server and the page actions the browser tests need (run a notebook, find a widget).

`LabServer` starts `python -m jupyterlab` on 127.0.0.1 with a random port and token, in a temporary folder
of notebook copies, with its own settings, workspaces, runtime and data folders (nothing of the user's is
read or written), and shuts it down with its kernels. `NotebookPage` drives one notebook in a Playwright
page: Run > Run All Cells from the menu bar, wait until every queued cell has run, save, find widgets by the
text of their description. `PageErrors` collects what the page logs as an error.
"""
from __future__ import annotations

import ast
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# JupyterLab user settings for a quiet, deterministic page: no news or update check (no network here), and
# every cell kept in the DOM (windowing off), so a cell far down the notebook can be found and read.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}

# What the page may log as an error without failing a test. Each entry: (regex on the message, regex on the
# URL of its source, why it is harmless). Nothing else is allowed.
ALLOWED_CONSOLE_ERRORS = [
    # The notebooks' "Open in Colab" badge is an image on colab.research.google.com. The test blocks every
    # request that leaves 127.0.0.1, so the image fails to load; the browser logs that as a console error.
    (r"^Failed to load resource", r"^https?://(?!127\.0\.0\.1[:/])", "external image (Colab badge) blocked offline"),
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_path() -> str | None:
    """Debian's chromium (apt-get install chromium), or None when it is not installed."""
    import shutil

    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@dataclass
class LabServer:
    """A JupyterLab server process serving `root`; `start()` waits until its API answers."""

    root: Path                      # the folder of notebook copies the server serves
    home: Path                      # settings, workspaces, runtime and data folders live here
    env: dict[str, str]             # extra environment for the server and its kernels
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def runtime_dir(self) -> Path:
        return self.home / "runtime"

    def start(self, timeout: float = 90.0) -> LabServer:
        """Write the settings, start the server (its kernels run this Python), wait for /api/status."""
        for name, value in LAB_SETTINGS.items():
            path = self.home / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        (self.home / "workspaces").mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "MPLBACKEND"))}
        env.update(self.env, JUPYTER_CONFIG_DIR=str(self.home / "config"), JUPYTER_DATA_DIR=str(self.home / "data"),
                   JUPYTER_RUNTIME_DIR=str(self.runtime_dir), JUPYTER_PLATFORM_DIRS="1")
        command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
                   f"--port={self.port}", "--port-retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={self.root}", "--ServerApp.terminals_enabled=False",
                   f"--LabApp.user_settings_dir={self.home / 'settings'}",
                   f"--LabApp.workspaces_dir={self.home / 'workspaces'}", "--LabApp.extension_manager=readonly"]
        self.log = (self.home / "server.log").open("wb")
        self.process = subprocess.Popen(command, cwd=self.root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"jupyter lab did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Ask the server to shut down (it stops its kernels); kill its process group if it lingers."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.api("POST", "/api/shutdown")
            except OSError:
                pass
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):   # the kernels are in the server's process group
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        self.process.wait(timeout=10)
        self.log.close()

    def api(self, method: str, path: str, body: dict | None = None):
        """One authenticated REST call; the decoded JSON answer (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def lab_url(self, workspace: str) -> str:
        """The URL of JupyterLab in a named, empty workspace (no tabs restored from other tests)."""
        return f"{self.base_url}/lab/workspaces/{workspace}?token={self.token}"

    def kernel_id(self, notebook: str) -> str:
        sessions = [s for s in self.api("GET", "/api/sessions") if s["path"].endswith(notebook)]
        if len(sessions) != 1:
            raise LookupError(f"expected one session for {notebook}, got {sessions}")
        return sessions[0]["kernel"]["id"]

    def wait_for_kernel(self, notebook: str, timeout: float = 90.0) -> None:
        """Wait until the notebook's session has a started, idle kernel."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [s["kernel"]["execution_state"] for s in self.api("GET", "/api/sessions")
                      if s["path"].endswith(notebook) and s.get("kernel")]
            if states == ["idle"]:
                return
            time.sleep(0.5)
        raise TimeoutError(f"no idle kernel for {notebook} within {timeout:.0f} s:\n{self.log_tail()}")

    def kernel_value(self, notebook: str, expression: str):
        """Evaluate a JSON-returning expression silently in the notebook's kernel (not in its history)."""
        from jupyter_client import BlockingKernelClient

        client = BlockingKernelClient(connection_file=str(self.runtime_dir / f"kernel-{self.kernel_id(notebook)}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=30)
            msg_id = client.execute("", silent=True, store_history=False,
                                    user_expressions={"v": f"__import__('json').dumps({expression})"})
            reply = client.get_shell_msg(timeout=30)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = client.get_shell_msg(timeout=30)
        finally:
            client.stop_channels()
        value = reply["content"]["user_expressions"]["v"]
        if value["status"] != "ok":
            raise RuntimeError(f"{expression} failed in the kernel: {value.get('ename')}: {value.get('evalue')}")
        return json.loads(ast.literal_eval(value["data"]["text/plain"]))   # text/plain is the str's repr

    def shutdown_kernel(self, notebook: str) -> None:
        """Free the notebook's kernel (CPU and memory) once its test is done."""
        for s in self.api("GET", "/api/sessions"):
            if s["path"].endswith(notebook):
                self.api("DELETE", f"/api/sessions/{s['id']}")

    def log_tail(self, n: int = 4000) -> str:
        path = self.home / "server.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""


class PageErrors:
    """Console errors and uncaught page errors of one page, minus ALLOWED_CONSOLE_ERRORS."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

    def _console(self, message) -> None:
        if message.type != "error":
            return
        url = (message.location or {}).get("url", "")
        if any(re.search(text, message.text) and re.search(source, url) for text, source, _ in ALLOWED_CONSOLE_ERRORS):
            return
        self.errors.append(f"console error: {message.text} (at {url})")


class NotebookPage:
    """One notebook open in JupyterLab, in a Playwright page."""

    def __init__(self, page, server: LabServer, notebook: str):
        self.page, self.server, self.notebook = page, server, notebook
        self.started = time.monotonic()
        # nothing leaves the machine: requests to any host but the server are refused
        page.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/])"), lambda route: route.abort())
        # open it as a user does, from the file browser: opened by URL, the notebook asks which kernel to start
        page.goto(server.lab_url(workspace=re.sub(r"\W", "-", Path(notebook).stem)))
        page.locator(".jp-DirListing-item").filter(
            has=page.locator(".jp-DirListing-itemText", has_text=re.compile(rf"^{re.escape(notebook)}$"))
        ).dblclick(timeout=90_000)
        self.panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        self.panel.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
        server.wait_for_kernel(notebook)
        self.log("opened, kernel idle")

    def log(self, what: str) -> None:
        """A timestamped progress line (pytest shows it with -s or when the test fails)."""
        print(f"[{time.monotonic() - self.started:6.1f} s] {self.notebook}: {what}", flush=True)

    def menu(self, *path: str) -> None:
        """Click through the menu bar, e.g. menu("Run", "Run All Cells")."""
        self.page.locator(".lm-MenuBar-item").filter(has_text=re.compile(rf"^{re.escape(path[0])}$")).click()
        for name in path[1:]:
            self.page.locator(".lm-Menu-item").filter(
                has=self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(name)}$"))).click()

    def run_all(self, timeout: float = 240.0) -> None:
        """Run > Run All Cells, then wait until no cell is queued or running and the kernel is idle."""
        self.menu("Run", "Run All Cells")
        self.wait_until_idle(timeout)
        self.log("ran all cells")

    def wait_until_idle(self, timeout: float) -> None:
        prompts = self.panel.locator(".jp-InputPrompt")
        running = prompts.filter(has_text="[*]")
        running.first.wait_for(timeout=30_000)     # the run has started (cells are queued at once)
        deadline = time.monotonic() + timeout
        quiet_since = None
        while time.monotonic() < deadline:
            status = self.page.locator(".jp-Notebook-ExecutionIndicator").get_attribute("data-status")
            if running.count() == 0 and status == "idle":
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 1.0:
                    return
            else:
                quiet_since = None
            time.sleep(0.25)
        raise TimeoutError(f"{self.notebook}: still running after {timeout:.0f} s "
                           f"({running.count()} cells queued or running)")

    def save(self) -> Path:
        """File > Save Notebook; the saved copy's path once the tab is no longer marked dirty."""
        self.menu("File", "Save Notebook")
        self.page.locator(".jp-mod-current.jp-mod-dirty").wait_for(state="detached", timeout=30_000)
        self.log("saved")
        return self.server.root / self.notebook

    def code_cell(self, contains: str):
        """The code cell whose source contains `contains`."""
        return self.panel.locator(".jp-CodeCell").filter(has=self.page.locator(".jp-InputArea", has_text=contains))

    def widget_panel(self, control_label: str):
        """The top-level widget box in an output area that holds a control described `control_label`."""
        return self.panel.locator(".jp-OutputArea-output > .widget-box").filter(has=self.control(control_label))

    def control(self, label: str):
        """A widget control found by its description (the text of its label)."""
        return self.page.locator(".jupyter-widgets.widget-inline-hbox").filter(
            has=self.page.locator(":scope > .widget-label", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$")))


def saved_notebook_errors(path: Path) -> list[str]:
    """Cells of a saved notebook that raised or never ran: '[index] ename: evalue' or '[index] not run'."""
    import nbformat

    problems = []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is None:
            problems.append(f"[{index}] not run: {cell.source[:80]!r}")
        problems += [f"[{index}] {o.ename}: {o.evalue}\n{_strip_ansi(chr(10).join(o.traceback))[-1500:]}"
                     for o in cell.outputs if o.output_type == "error"]
    return problems


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
