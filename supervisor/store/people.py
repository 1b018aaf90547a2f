"""People's API tokens: who holds one, as its hash (supervisor/people.py)."""

from __future__ import annotations

from sqlalchemy import Connection, delete, insert, select

from supervisor.domain import Person
from supervisor.store import schema as t


class PeopleQueries:
    c: Connection

    def person_by_token_hash(self, token_sha256: str) -> Person | None:
        row = self.c.execute(select(t.people).where(t.people.c.token_sha256 == token_sha256)).first()
        if row is None:
            return None
        return Person(user=row.user, operator=bool(row.operator), issued_at=row.issued_at)

    def set_person(self, person: Person, token_sha256: str) -> None:
        """``person``'s token, replacing any earlier one of theirs."""
        self.c.execute(delete(t.people).where(t.people.c.user == person.user))
        self.c.execute(insert(t.people).values(user=person.user, token_sha256=token_sha256,
                                               operator=int(person.operator), issued_at=person.issued_at))

    def remove_person(self, user: str) -> bool:
        return bool(self.c.execute(delete(t.people).where(t.people.c.user == user)).rowcount)

    def list_people(self) -> list[Person]:
        rows = self.c.execute(select(t.people).order_by(t.people.c.user))
        return [Person(user=r.user, operator=bool(r.operator), issued_at=r.issued_at) for r in rows]
