"""What the CMA tests share: the op context that chorus.shm.cma's errors describe."""


class Ctx:
    members = (10, 11)

    @staticmethod
    def describe():
        return "all_gather (seq 7) on group 0"
