"""infermesh.v1.Admin on any service's port: authorize the caller, then answer its StatusReport.

The only place a StatusReport meets protobuf (both ways: the CLI decodes replies with
`from_proto`). Each service hands in two callables: `authorize(peer, metadata, has_cert)`,
which raises Unauthenticated / PermissionDenied, and `report()`, which assembles the status.
"""

from __future__ import annotations

import logging

import grpc

from infermesh.v1 import admin_pb2, admin_pb2_grpc
from services.common import admin
from services.common.errors import InvalidArgument
from services.common.identity import peer_identity
from services.common.status import maps_domain_errors

log = logging.getLogger(__name__)

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


_ACTIONS = {
    admin_pb2.ControlRolloutRequest.ACTION_PAUSE: "pause",
    admin_pb2.ControlRolloutRequest.ACTION_RESUME: "resume",
    admin_pb2.ControlRolloutRequest.ACTION_ABORT: "abort",
    admin_pb2.ControlRolloutRequest.ACTION_PROMOTE: "promote",
}
ACTION_BY_NAME = {name: number for number, name in _ACTIONS.items()}


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, authorize: admin.Authorize, report: admin.Report,
                 control_rollout: admin.ControlRollout | None = None) -> None:
        """control_rollout: the gateway's; None elsewhere (ControlRollout answers UNIMPLEMENTED)."""
        self._authorize = authorize
        self._report = report
        self._control_rollout = control_rollout

    def _check(self, context) -> None:
        has_cert = peer_identity(context.auth_context()) is not None
        self._authorize(context.peer(), context.invocation_metadata() or (), has_cert)

    @maps_domain_errors
    async def GetStatus(self, request: admin_pb2.GetStatusRequest, context) -> admin_pb2.ServiceStatus:
        self._check(context)
        return to_proto(self._report())

    @maps_domain_errors
    async def ControlRollout(self, request: admin_pb2.ControlRolloutRequest,
                             context) -> admin_pb2.ControlRolloutResponse:
        self._check(context)
        if self._control_rollout is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "rollouts are controlled at a gateway, not here")
        action = _ACTIONS.get(request.action)
        if action is None:
            raise InvalidArgument(f"action must be pause, resume, abort or promote, got {request.action}")
        assert self._control_rollout is not None
        outcome = self._control_rollout(request.model, action, f"by hand: Admin/ControlRollout from "
                                                               f"{admin.peer_host(context.peer())}")
        return admin_pb2.ControlRolloutResponse(
            model=outcome.model, canary_version=outcome.canary_version, state=outcome.state, step=outcome.step,
            canary_percent=outcome.canary_percent, decision=outcome.decision)


def add_to_server(servicer: AdminServicer, server) -> None:
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)


# --------------------------------------------------------------------------- codec


def _value(cell: admin.Cell) -> admin_pb2.StatusValue:
    if isinstance(cell, bool):  # before int: bool is an int
        return admin_pb2.StatusValue(flag=cell)
    if isinstance(cell, int):
        return admin_pb2.StatusValue(integer=cell)
    if isinstance(cell, float):
        return admin_pb2.StatusValue(number=cell)
    return admin_pb2.StatusValue(text=str(cell))


def _cell(value: admin_pb2.StatusValue) -> admin.Cell:
    kind = value.WhichOneof("kind")
    return "" if kind is None else getattr(value, kind)


def to_proto(report: admin.StatusReport) -> admin_pb2.ServiceStatus:
    return admin_pb2.ServiceStatus(
        service=report.service,
        version=report.version,
        uptime_s=report.uptime_s,
        facts=[admin_pb2.StatusFact(key=key, value=_value(cell)) for key, cell in report.facts],
        sections=[
            admin_pb2.StatusSection(
                name=s.name, columns=s.columns,
                rows=[admin_pb2.StatusRow(cells=[_value(c) for c in row]) for row in s.rows],
            )
            for s in report.sections
        ],
    )


def from_proto(message: admin_pb2.ServiceStatus) -> admin.StatusReport:
    """Raises ValueError when a row's width does not match its columns (a reply from a broken peer)."""
    return admin.StatusReport(
        service=message.service,
        version=message.version,
        uptime_s=message.uptime_s,
        facts=tuple((fact.key, _cell(fact.value)) for fact in message.facts),
        sections=tuple(
            admin.Section(s.name, tuple(s.columns), tuple(tuple(_cell(c) for c in row.cells) for row in s.rows))
            for s in message.sections
        ),
    )
